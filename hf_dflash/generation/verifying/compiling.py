"""Compiled decoding as Transformers runs it: a `StaticCache` and `compile_config`, and when to use them.

`generate` compiles its decoding step (plain decoding) or our loop's verification forward (`decoding.py`)
when the cache is compileable and `compile_config` allows the device (Transformers compiles on
accelerators only unless `compile_config._compile_all_devices`). `compiled_generate_kwargs` builds both for
one call; `choose_compile` decides `--compile auto|on|off`.
"""

from __future__ import annotations

import torch
from transformers import CompileConfig, StaticCache
from transformers.cache_utils import StaticLayer

from ...caches import cache_keyword

__all__ = [
    "COMPILE_SETTINGS",
    "STATIC_SLOT_MULTIPLE",
    "choose_compile",
    "compiled_generate_kwargs",
    "static_cache",
    "static_slots",
]

COMPILE_SETTINGS = ("auto", "on", "off")
# A static cache's length is part of every compiled graph's shapes: lengths are rounded up to this multiple so
# requests of similar lengths share a graph, while a step still attends over no more than this many empty slots.
STATIC_SLOT_MULTIPLE = 256


def static_slots(max_length: int, block_size: int = 0, multiple: int = STATIC_SLOT_MULTIPLE) -> int:
    """Slots for a generation up to `max_length` tokens whose compiled rounds verify `block_size` tokens: room
    for a padded last block (`target_forward.pad_round`), rounded up to `multiple`."""
    needed = max_length + block_size
    return -(-needed // multiple) * multiple


def compiled_generate_kwargs(target, slots: int, plain: bool = False) -> dict:
    """`generate` keyword arguments for a compiled call: a StaticCache of `slots` slots (`static_slots`,
    `static_cache`) and a `CompileConfig` that also compiles on CPU (`mode="reduce-overhead"`, CUDA graphs, on
    CUDA). `plain`: the call decodes plainly (no drafter)."""
    config = CompileConfig(dynamic=False, mode="reduce-overhead" if target.device.type == "cuda" else None)
    config._compile_all_devices = True  # Transformers 5.23-5.25 compile generate's step on accelerators only
    return {cache_keyword(target): static_cache(target, slots, plain), "compile_config": config}


def static_cache(target, slots: int, plain: bool = False) -> StaticCache:
    """A StaticCache of `slots` slots for `target` whose sliding-window layers are full static layers where that
    changes no attention: always for plain decoding (Transformers masks a sliding layer by the config's window,
    so keys past it are masked rather than evicted; the layer attends over all slots), and for our loop where
    the window covers every slot (nothing is ever evicted). Other sliding layers stay Transformers' (our loop's
    tree masks do not encode a window; it refuses those layers when generation can pass the window).

    Why: Transformers 5.23-5.25's StaticSlidingWindowLayer keeps its length in a Python int
    (`cumulative_length_int`) and branches on it; a compiled step (`dynamic=False`) guards on its value, so every
    decoding step recompiled until dynamo's recompile limit, then ran eager (Gemma 3 270M: 348 s for 128 tokens).
    A full StaticLayer keeps its length in a tensor: one graph per cache length."""
    cache = StaticCache(config=target.config, max_cache_len=slots)
    window = getattr(target.config.get_text_config(decoder=True), "sliding_window", None)
    if plain or (window is not None and window >= slots):
        cache.layers = [StaticLayer(max_cache_len=slots) if layer.is_sliding else layer for layer in cache.layers]
    return cache


def choose_compile(setting: str, device: torch.device | str) -> tuple[bool, str]:
    """(compile or not, why) for `--compile auto|on|off`.

    `auto` follows Transformers' own default: compiled on accelerators (CUDA graphs remove the launch and
    Python overhead of a round's small kernels), eager on CPU, where each static cache length first costs
    30-48 s of compile (2-core Zen 4/5, Xeon with AMX) that a short run never repays (rounds run their linear layers
    packed where that pays, eager or compiled). Measured (docs/results-history.md): Zen 5 fp32,
    eager DFlash 1.43x the fastest plain, compiled 1.00x; Zen 4 bf16, compiled worth 1.14x over long runs; Xeon
    AMX bf16, compiled rounds 1.06-1.26x faster than eager but 45 s of compile, repaid after ~4,000 tokens. A new
    process over torch's warm on-disk cache still compiles 8 s per shape (Xeon AMX, plain decoding 1.15x faster
    compiled in bf16: repaid after ~860 tokens, 1.05x in fp32: ~2,400; benchmarks/generation/compile_cost.py)."""
    if setting not in COMPILE_SETTINGS:
        raise ValueError(f"--compile must be one of {', '.join(COMPILE_SETTINGS)}, got {setting!r}.")
    device_type = torch.device(device).type
    if setting == "auto":
        if device_type == "cpu":
            return (
                False,
                "auto: eager on CPU (each cache length compiles 30-48 s, repaid only over thousands of tokens; 'on' for long runs)",
            )
        return True, f"auto: compiled on {device_type} (static cache, CUDA graphs)"
    return setting == "on", setting
