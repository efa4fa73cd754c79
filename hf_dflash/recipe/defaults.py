"""Settings a user must choose, derived from the target's config when the recipe config leaves them out.

Each derived setting comes with its reason (printed, and recorded in the card: `derived_settings` of the
training record). The anchors: the DFlash paper (5 draft layers, 5 target features, block 16 on 4B-8B
targets) and this repository's shipped SmolLM2-135M drafter (2 layers, block 8, a draft vocabulary of the
8,192 most frequent reply tokens of 49,152: docs/drafter-history.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..modeling_dflash import default_target_layer_ids

__all__ = ["DerivedSetting", "derive_defaults"]

PAPER_FEATURES = 5
LARGE_HIDDEN = 2048  # ~1B parameters and up: the paper's regime
MEDIUM_HIDDEN = 1024
FULL_VOCAB_UP_TO = 16384  # below this the full LM head is cheap next to the drafter's layers
MAX_DRAFT_VOCAB = 32768  # EAGLE-3's draft vocabulary


@dataclass(frozen=True)
class DerivedSetting:
    """One setting of the recipe: its value, where it comes from ("derived" or "config") and why."""

    name: str
    value: object
    source: str
    reason: str

    def line(self) -> str:
        return f"{self.name} = {self.value!r} ({self.source}: {self.reason})"

    def record(self) -> dict:
        return {"value": self.value, "source": self.source, "reason": self.reason}


def _layers(num_layers: int) -> tuple[list[int], str]:
    features = PAPER_FEATURES if num_layers >= PAPER_FEATURES + 3 else max(1, min(PAPER_FEATURES, num_layers - 3))
    ids = default_target_layer_ids(num_layers, features)
    if features == PAPER_FEATURES:
        why = f"{features} features as in the DFlash paper, spread evenly over layers 1..L-3 of the {num_layers}-layer target"
    else:
        why = f"a {num_layers}-layer target has room for {features} distinct feature(s) (the paper's {PAPER_FEATURES} need >= 8 layers)"
    return ids, why


def _block_size(hidden: int) -> tuple[int, str]:
    if hidden >= LARGE_HIDDEN:
        return 16, f"hidden size {hidden} >= {LARGE_HIDDEN}: the paper's block size for 4B-8B targets"
    return 8, (
        f"hidden size {hidden} < {LARGE_HIDDEN}: the shipped SmolLM2-135M drafter trains with 8 "
        "(its tau is 2-4: longer blocks add verification cost, not accepted tokens)"
    )


def _depth(hidden: int, num_layers: int) -> tuple[int, str]:
    if num_layers <= 8:
        return 1, f"a {num_layers}-layer target: one draft layer keeps drafting well under one target forward"
    if hidden >= LARGE_HIDDEN:
        return 5, f"hidden size {hidden} >= {LARGE_HIDDEN}: the paper's 5 draft layers"
    if hidden >= MEDIUM_HIDDEN:
        return 3, f"hidden size {hidden}: between the shipped small drafter (2) and the paper's 5"
    return (
        2,
        f"hidden size {hidden} < {MEDIUM_HIDDEN}: the shipped SmolLM2-135M drafter's 2 layers",
    )


def _draft_vocab(vocab: int) -> tuple[int | None, str]:
    if vocab <= FULL_VOCAB_UP_TO:
        return None, f"vocabulary {vocab} <= {FULL_VOCAB_UP_TO}: the full LM head is cheap, keep every row"
    size = min(MAX_DRAFT_VOCAB, 2 ** round(math.log2(vocab / 6)))
    return size, (
        f"vocabulary {vocab}: the drafter's LM-head rows cost as much as its layers; about 1/6 of the rows as a "
        f"power of two (the shipped drafter: 8,192 of 49,152), at most {MAX_DRAFT_VOCAB}, chosen by training as "
        "the most frequent supervised tokens"
    )


def derive_defaults(target_config, drafter: dict, training: dict) -> list[DerivedSetting]:
    """The four user-facing choices for a target with `target_config`: each from the recipe config's `drafter` /
    `training` sections when set there, else derived (with the reason)."""
    text = target_config.get_text_config()
    layers, hidden, vocab = text.num_hidden_layers, text.hidden_size, text.vocab_size
    derived = {
        "target_layer_ids": _layers(layers),
        "block_size": _block_size(hidden),
        "draft_vocab_size": _draft_vocab(vocab),
        "num_hidden_layers": _depth(hidden, layers),
    }
    given = {**drafter, **({"block_size": training["block_size"]} if "block_size" in training else {})}
    if "num_target_features" in drafter and "target_layer_ids" not in drafter:
        given["target_layer_ids"] = default_target_layer_ids(layers, drafter["num_target_features"])
    settings = []
    for name, (value, reason) in derived.items():
        if name in given:
            settings.append(DerivedSetting(name, given[name], "config", "set in the recipe config"))
        else:
            settings.append(DerivedSetting(name, value, "derived", reason))
    return settings
