"""The target, its tokenizer and the drafter of a benchmark run, and a description of the machine."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from ..checkpoints import load_drafter
from ..dtypes import AUTO, cpu_flags, resolve_dtype
from ..modeling_dflash import DFlashConfig, DFlashDraftModel
from ..targets import load_any_target, resolve_device

__all__ = [
    "RANDOM_DRAFTER",
    "BenchModels",
    "check_block_size_policy",
    "load_bench_models",
    "machine_description",
    "random_drafter",
    "recorded_block_size",
]

RANDOM_DRAFTER = "random"


@dataclass
class BenchModels:
    target: transformers.PreTrainedModel
    tokenizer: transformers.PreTrainedTokenizerBase
    drafter: DFlashDraftModel
    drafter_description: str  # says so when the drafter is random


def random_drafter(
    target, tokenizer, seed: int = 0, num_hidden_layers: int = 3, block_size: int = DFlashConfig.block_size
) -> DFlashDraftModel:
    """An untrained drafter for `target` (up to 5 target features, fewer for a shallow target)."""
    num_features = min(5, max(1, target.config.get_text_config().num_hidden_layers - 3))
    config = DFlashConfig.from_target_config(
        target.config,
        num_hidden_layers=num_hidden_layers,
        block_size=block_size,
        num_target_features=num_features,
        tokenizer=tokenizer,
    )
    torch.manual_seed(seed)
    return DFlashDraftModel(config)


def recorded_block_size(drafter: str) -> int | None:
    """The block size `drafter` ("random", or a local checkpoint folder of any format) records, read from its
    config.json without loading it; None where it cannot be read that way (a Hub id, a damaged folder: the
    loader names the problem later)."""
    from ..checkpoints.files import read_config
    from ..checkpoints.loading import detect_format

    if drafter == RANDOM_DRAFTER:
        return DFlashConfig.block_size  # random_drafter's
    folder = Path(drafter)
    if not (folder / "config.json").is_file():
        return None
    try:
        config, kind = read_config(folder), detect_format(folder)
    except ValueError:
        return None
    block = config.get("dflash_config", {}).get("block_size") if kind == "official" else config.get("block_size")
    if kind == "hub" and block is None:
        block = DFlashConfig.block_size
    return block if isinstance(block, int) and not isinstance(block, bool) else None


def check_block_size_policy(policy: str, drafter: str) -> None:
    """A `--block-size-policy` refused before any model loads: checked against the block size the drafter's config
    records (`recorded_block_size`), or for its spelling alone where that cannot be read without loading."""
    from ..generation.policies.block_size import parse_block_size_policy

    block = recorded_block_size(drafter)
    if block is not None:
        parse_block_size_policy(policy, block)
    elif policy not in ("recommended", "trained", "adaptive", "confidence") and not policy.isdigit():
        raise ValueError(
            f"block size policy {policy!r}: use 'recommended' (the drafter config's), 'trained' (the drafter's "
            "block size), 'adaptive', 'confidence', or a block length k with 1 <= k <= the block size."
        )


def load_bench_target(name: str, dtype: torch.dtype):
    """A known target or a local Transformers folder, with its tokenizer (required to render prompts)."""
    model, tokenizer = load_any_target(name, dtype)
    if tokenizer is None:
        raise ValueError(f"Target folder {name!r} has no tokenizer; save one next to the model.")
    return model, tokenizer


def load_bench_models(
    target: str, drafter: str, dtype: torch.dtype | str = AUTO, device: str | None = None, seed: int = 0
) -> BenchModels:
    """Load the target in `dtype` on `device` (default: CUDA when available) and the drafter cast to the same
    dtype: a checkpoint folder in either format (`load_drafter`), or "random" for an untrained 3-layer drafter.
    `dtype="auto"` picks the fast dtype for the device (`hf_dflash.dtypes.choose_dtype`)."""
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    model, tokenizer = load_bench_target(target, dtype)
    model.to(device)
    if drafter == RANDOM_DRAFTER:
        draft_model = random_drafter(model, tokenizer, seed=seed)
        description = (
            f"RANDOM untrained drafter ({draft_model.config.num_hidden_layers} layers, block "
            f"{draft_model.config.block_size}, seed {seed}): τ ≈ 1, so DFlash is slower than plain decoding"
        )
    else:
        draft_model = load_drafter(drafter, dtype=dtype)
        description = drafter
    return BenchModels(model, tokenizer, draft_model.to(device=device, dtype=dtype).eval(), description)


def _cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _bf16_support() -> str:
    """ "native bf16: amx_bf16, avx512_bf16" or "no native bf16" (the flags decide dtype="auto")."""
    flags = cpu_flags()
    if flags is None:
        return "CPU flags unreadable"
    native = sorted(flag for flag in ("avx512_bf16", "amx_bf16", "bf16") if flag in flags)
    return f"native bf16: {', '.join(native)}" if native else "no native bf16"


def machine_description(device: torch.device) -> str:
    """E.g. "1x NVIDIA H200, torch 2.13.0, transformers 5.24.0" or "<CPU model>, 2 threads, OpenMP wait policy
    default, torch ..." (the wait policy changes every CPU figure: `OMP_WAIT_POLICY=PASSIVE` made a 2-core Intel
    Xeon's forwards ~1.6x slower than the default)."""
    if device.type == "cuda":
        where = f"1x {torch.cuda.get_device_name(device)}"
    else:
        policy = os.environ.get("OMP_WAIT_POLICY") or "default"
        where = f"{_cpu_name()} ({_bf16_support()}), {torch.get_num_threads()} threads, OpenMP wait policy {policy}"
    return f"{where}, torch {torch.__version__}, transformers {transformers.__version__}"
