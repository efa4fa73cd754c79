"""Linear layers through oneDNN with prepacked weights: the CPU GEMM lever for decoding.

On CPU, `nn.Linear` goes to aten's matmul, which sends fp32 products to MKL's sgemm. For the few rows a
decoding step (1) or a verification round (8-32) multiplies, that kernel runs far below the machine: on a
2-core AMD EPYC Zen 5 (torch 2.13, MKL 2024.2) SmolLM2-135M's fp32 MLP projection (1536 x 576) takes
171 us for 8 rows where oneDNN's matmul over the same weight, reordered once into its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, what inductor's freezing pass does for its own graphs), takes
53 us; its 49 k-row LM head 11.6 vs 3.0 ms; a whole 8-token forward 82.9 vs 48.1 ms, a 1-token one 45.4 vs
39.6 (benchmarks/generation/cost_curve.py). bf16 products already go to oneDNN there: packing left the
whole forward where it was (42.4 vs 43.0 ms at 8 tokens), so only float32 is packed by measurement
(`packing_pays`), never assumed; `packed_linears` packs bf16 layers too when asked:

    with packed_linears(target, drafter):        # every packable nn.Linear inside runs through oneDNN
        target.generate(**inputs)                 # plain decoding, or DFlash (`drafter.linear_packing`)

A packed layer computes the same product in another summation order: its outputs equal the default path's up
to rounding, as the default path's own 1-row and 8-row kernels differ from each other. Only CPU layers in
float32 or bfloat16 without autograd are packed (a forward that needs gradients runs the default path). The
packed copy of a weight is made on first use and kept on the layer (`release_packed_weights` frees it); a
weight changed in place or replaced is packed again. The layers' parameters and `state_dict` are untouched.
"""

from __future__ import annotations

import time
import types
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = [
    "PACKABLE_DTYPES",
    "PACK_ROWS",
    "is_packed",
    "linear_packing_supported",
    "packed_linears",
    "packing_pays",
    "release_packed_weights",
]

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
PACK_ATTRIBUTE = "_hf_dflash_packed_weight"  # (weight, its key, packed weight) on a layer that was packed
PACKED_ROWS = "_hf_dflash_rows"  # on a layer while it runs packed: the row count its pack is laid out for
PACK_ROWS = 8  # the row count packs are laid out for by default (a pack made for other rows is made again)
PAYS_FROM = 1.1  # packing is chosen where the measured product is at least this much faster
_PAYS: dict[tuple, bool] = {}  # (dtype, out, in, rows, threads) -> measured verdict, once per process


def linear_packing_supported() -> bool:
    """Whether this torch build has oneDNN's prepacked linear (CPU builds with MKL-DNN)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def packable(layer: nn.Module) -> bool:
    """A plain CPU `nn.Linear` in a packable dtype whose forward nobody else has replaced."""
    return (
        type(layer) is nn.Linear
        and layer.weight.device.type == "cpu"
        and layer.weight.dtype in PACKABLE_DTYPES
        and "forward" not in vars(layer)
    )


def packed_weight(layer: nn.Linear, rows: int) -> torch.Tensor:
    """The layer's weight reordered for oneDNN (an opaque MKL-DNN tensor), made again when the weight is replaced
    or changed in place (the cached pack holds the weight it was made from, so its storage is never reused)."""
    weight = layer.weight
    cached = layer.__dict__.get(PACK_ATTRIBUTE)
    if cached is None or cached[0] is not weight or cached[1] != (weight.data_ptr(), weight._version, rows):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)
        cached = (weight, (weight.data_ptr(), weight._version, rows), packed)
        layer.__dict__[PACK_ATTRIBUTE] = cached
    return cached[2]


def packed_forward(layer: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """`layer(hidden)` (..., in) -> (..., out) through the packed weight; the default path where autograd
    is needed or the input does not match the weight's dtype and device."""
    weight, bias = layer.weight, layer.bias
    if (
        hidden.dtype != weight.dtype
        or hidden.device.type != "cpu"
        or (
            torch.is_grad_enabled()
            and (hidden.requires_grad or weight.requires_grad or getattr(bias, "requires_grad", False))
        )
    ):
        return nn.Linear.forward(layer, hidden)
    packed = packed_weight(layer, layer.__dict__[PACKED_ROWS])
    return torch.ops.mkldnn._linear_pointwise(hidden, packed, bias, "none", [], "")


@contextmanager
def packed_linears(*modules: nn.Module, rows: int = PACK_ROWS) -> Iterator[int]:
    """Run every packable `nn.Linear` in `modules` through oneDNN with its weight prepacked for `rows`-row
    products (packs serve any row count; `rows` is the count they are laid out for), restoring the layers'
    own forward on exit. Yields the number of layers packed (0 where this torch build cannot)."""
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        raise ValueError(f"rows={rows!r}: must be a positive int (the row count the packed layout is made for).")
    layers = []
    if linear_packing_supported():
        seen: set[int] = set()
        for module in modules:
            for layer in module.modules():
                if id(layer) not in seen and packable(layer):
                    seen.add(id(layer))
                    layers.append(layer)
    try:
        for layer in layers:
            setattr(layer, PACKED_ROWS, rows)
            layer.forward = types.MethodType(packed_forward, layer)
        yield len(layers)
    finally:
        for layer in layers:
            del layer.forward
            delattr(layer, PACKED_ROWS)


def is_packed(module: nn.Module) -> bool:
    """Whether `module`'s linear layers run packed right now (inside `packed_linears`)."""
    return any(PACKED_ROWS in vars(layer) for layer in module.modules())


def release_packed_weights(*modules: nn.Module) -> None:
    """Free the packed copies `packed_linears` kept on the layers of `modules`."""
    for module in modules:
        for layer in module.modules():
            if PACK_ATTRIBUTE in vars(layer):
                delattr(layer, PACK_ATTRIBUTE)


def largest_linear(module: nn.Module) -> nn.Linear | None:
    """The packable layer with the most weights outside the LM head (the product a forward repeats most)."""
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    layers = [layer for layer in module.modules() if packable(layer) and layer is not head]
    return max(layers, key=lambda layer: layer.weight.numel(), default=None)


def time_product(run, repeats: int = 20) -> float:
    """The fastest of `repeats` timed calls of `run` (after two warm-up calls), in seconds."""
    run(), run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def packing_pays(module: nn.Module, rows: int = PACK_ROWS) -> bool:
    """Whether packing makes `module`'s float32 linear layers faster on this machine: its largest layer's product
    over `rows` rows timed both ways (a few ms, once per shape and thread count in a process). bf16: False
    (aten already runs oneDNN; one layer timed alone looked faster packed where the whole forward was not)."""
    layer = largest_linear(module)
    if layer is None or layer.weight.dtype != torch.float32 or not linear_packing_supported():
        return False
    weight = layer.weight.detach()
    key = (weight.dtype, *weight.shape, rows, torch.get_num_threads())
    if key not in _PAYS:
        hidden = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        default = time_product(lambda: nn.functional.linear(hidden, weight))
        oned = time_product(lambda: torch.ops.mkldnn._linear_pointwise(hidden, packed, None, "none", [], ""))
        _PAYS[key] = default >= PAYS_FROM * oned
    return _PAYS[key]
