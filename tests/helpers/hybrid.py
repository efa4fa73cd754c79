"""Helpers shared by the hybrid (n-gram copying + DFlash) generation tests: prompts that may repeat a span."""

import torch

from tests.conftest import VOCAB


def prompt(seed: int, repeats: bool, length: int = 8) -> torch.LongTensor:
    """A random prompt; with `repeats`, a random span written three times (copying pays from the start)."""
    generator = torch.Generator().manual_seed(seed)
    if not repeats:
        return torch.randint(3, VOCAB, (1, length), generator=generator)
    span = torch.randint(3, VOCAB, (1, length // 2), generator=generator)
    return torch.cat([span, span, span[:, : length // 4 + 1]], 1)
