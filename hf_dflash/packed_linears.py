"""Linear layers through oneDNN with prepacked weights: the CPU GEMM lever for decoding.

On CPU, `nn.Linear` goes to aten's matmul, which sends fp32 products to MKL's sgemm. For the few rows a
decoding step (1) or a verification round (8-32) multiplies, that kernel runs far below the machine: on a
2-core AMD EPYC Zen 5 (torch 2.13, MKL 2024.2) SmolLM2-135M's fp32 MLP projection (1536 x 576) takes
171 us for 8 rows where oneDNN's matmul over the same weight, reordered once into its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, what inductor's freezing pass does for its own graphs), takes
53 us; its 49 k-row LM head 11.6 vs 3.0 ms; a whole 8-token forward 82.9 vs 48.1 ms, a 1-token one 45.4 vs
39.6 (benchmarks/generation/cost_curve.py). bf16 products already go to oneDNN, yet on a 2-core Intel Xeon
with AMX packing still made a whole bf16 forward 1.15-1.2x faster at every width (47.1 vs 39.1 ms at 1 token,
51.8 vs 45.2 at 8) under OpenMP's default wait policy, where under `OMP_WAIT_POLICY=PASSIVE` (which earlier
measurements used) it gained nothing: so no dtype is assumed, each is packed by measurement (`packing_pays`,
every layer's product streamed once, as a forward runs them); `packed_linears` packs whatever it is given:

    with packed_linears(target, drafter):        # every packable nn.Linear inside runs through oneDNN
        target.generate(**inputs)                 # plain decoding, or DFlash (`drafter.linear_packing`)

A packed layer computes the same product in another summation order: its outputs equal the default path's up
to rounding, as the default path's own 1-row and 8-row kernels differ from each other. Only CPU layers in
float32 or bfloat16 without autograd are packed (a forward that needs gradients runs the default path), bfloat16
only where oneDNN has a bf16 path on this CPU (`packable_dtypes`: torch 2.13 refuses to reorder a bf16 weight on an
AVX2-only CPU). The
packed copy of a weight is made on entering `packed_linears` and kept on the layer (`release_packed_weights` frees
it); an eager call packs a weight changed in place or replaced again. The layers' parameters and `state_dict` are
untouched. Inside `torch.compile` the packed product is one opaque op (`packed_linear`) over the pack made on
entry: compiled verification and compiled plain decoding run packed too.
"""

from __future__ import annotations

import functools
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
    "packable_dtypes",
    "packed_linears",
    "packing_floor",
    "packing_pays",
    "release_packed_weights",
]

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)  # the dtypes packing serves; on this machine: `packable_dtypes()`
PACK_ATTRIBUTE = "_hf_dflash_packed_weight"  # (weight, its key, packed weight) on a layer that was packed
PACKED_ROWS = "_hf_dflash_rows"  # on a layer while it runs packed: the row count its pack is laid out for
PACKED_FROM = "_hf_dflash_from_rows"  # on a layer while it runs packed: products of fewer rows take the default path
PACK_ROWS = 8  # the row count packs are laid out for by default (a pack made for other rows is made again)
PAYS_FROM = 1.1  # packing is chosen where the measured product is at least this much faster
FLOOR_PROBES = (1, 4)  # row counts timed below `rows`, in turn, for the fewest rows packing pays from
_PAYS: dict[tuple, bool] = {}  # (dtype, layer shapes, rows, threads) -> measured verdict, once per process


def linear_packing_supported() -> bool:
    """Whether this torch build has oneDNN's prepacked linear (CPU builds with MKL-DNN)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def onednn_bf16_supported() -> bool:
    """Whether oneDNN multiplies bf16 on this CPU. torch 2.13 refuses to reorder a bf16 weight without AVX-512
    (BW/VL/DQ) or AVX-NE-CONVERT ('mkldnn_reorder_linear_weight: bf16 path needs the cpu support ...'), e.g. on an
    AVX2-only AMD EPYC."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def packable_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes `packed_linears` packs on this machine: float32 wherever the build has oneDNN's
    prepacked linear, bfloat16 where its bf16 path runs on this CPU too (`onednn_bf16_supported`)."""
    if not linear_packing_supported():
        return ()
    return PACKABLE_DTYPES if onednn_bf16_supported() else (torch.float32,)


def packable(layer: nn.Module) -> bool:
    """A plain CPU `nn.Linear` in a dtype packed on this machine (`packable_dtypes`) whose forward nobody else has
    replaced."""
    return (
        type(layer) is nn.Linear
        and layer.weight.device.type == "cpu"
        and layer.weight.dtype in packable_dtypes()
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
    is needed, the input does not match the weight's dtype and device, or it has fewer rows than packing pays from."""
    weight, bias = layer.weight, layer.bias
    if (
        hidden.numel() < layer.__dict__[PACKED_FROM] * hidden.shape[-1]
        or hidden.dtype != weight.dtype
        or hidden.device.type != "cpu"
        or (
            torch.is_grad_enabled()
            and (hidden.requires_grad or weight.requires_grad or getattr(bias, "requires_grad", False))
        )
    ):
        return nn.Linear.forward(layer, hidden)
    if torch.compiler.is_compiling():  # the pack made on entering `packed_linears`, through an op inductor keeps
        return packed_linear(hidden, layer.__dict__[PACK_ATTRIBUTE][2], bias, layer.out_features)
    return onednn_product(hidden, packed_weight(layer, layer.__dict__[PACKED_ROWS]), bias)


def onednn_product(hidden: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(..., in) -> (..., out): oneDNN's linear over a weight `packed` by `packed_weight`."""
    return torch.ops.mkldnn._linear_pointwise(hidden, packed, bias, "none", [], "")


# The op a compiled graph calls for a packed product: inductor lowers oneDNN's linear only over weights it froze
# itself (torch 2.13 asserts the weight is a graph constant), so the graph calls the product through this opaque op
# instead. Defined with `torch.library.Library` rather than `torch.library.custom_op`, whose Python autograd wrapper
# costs ~10 us a call under no_grad (2 us this way; 211 calls a SmolLM2 forward: ~2 ms a round; torch 2.13). With no
# autograd kernel a call that needs gradients fails: `packed_forward` takes the default path there.
_LIBRARY = torch.library.Library("hf_dflash", "DEF")
_LIBRARY.define("packed_linear(Tensor hidden, Tensor packed, Tensor? bias, SymInt out_features) -> Tensor")


def _packed_linear(
    hidden: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """(..., in) -> (..., out_features) through a weight `packed` by `packed_weight`."""
    return onednn_product(hidden, packed, bias)


_LIBRARY.impl("packed_linear", _packed_linear, "CompositeExplicitAutograd")  # the pack is an MkldnnCPU tensor


@torch.library.register_fake("hf_dflash::packed_linear", lib=_LIBRARY)
def _packed_linear_shape(hidden, packed, bias, out_features):
    return hidden.new_empty(*hidden.shape[:-1], out_features)


packed_linear = torch.ops.hf_dflash.packed_linear.default


@contextmanager
def packed_linears(*modules: nn.Module, rows: int = PACK_ROWS, from_rows: int = 1) -> Iterator[int]:
    """Run every packable `nn.Linear` in `modules` through oneDNN with its weight prepacked for `rows`-row
    products (packs serve any row count; `rows` is the count they are laid out for), products of fewer than
    `from_rows` rows through the default path (`packing_floor`), restoring the layers' own forward on exit.
    Yields the number of layers packed (0 where this torch build cannot)."""
    for name, value in (("rows", rows), ("from_rows", from_rows)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r}: must be a positive int (a row count of the products packed).")
    layers = packable_layers(nn.ModuleList(modules))  # none where this build or CPU packs nothing (`packable_dtypes`)
    try:
        for layer in layers:
            packed_weight(layer, rows)  # made (or checked) now: a compiled forward reads the pack as it is
            setattr(layer, PACKED_ROWS, rows)
            setattr(layer, PACKED_FROM, from_rows)
            layer.forward = types.MethodType(packed_forward, layer)
        yield len(layers)
    finally:
        for layer in layers:
            del layer.forward
            delattr(layer, PACKED_ROWS)
            delattr(layer, PACKED_FROM)


def is_packed(module: nn.Module) -> bool:
    """Whether `module`'s linear layers run packed right now (inside `packed_linears`)."""
    return any(PACKED_ROWS in vars(layer) for layer in module.modules())


def release_packed_weights(*modules: nn.Module) -> None:
    """Free the packed copies `packed_linears` kept on the layers of `modules`."""
    for module in modules:
        for layer in module.modules():
            if PACK_ATTRIBUTE in vars(layer):
                delattr(layer, PACK_ATTRIBUTE)


def packable_layers(module: nn.Module) -> list[nn.Linear]:
    """Every packable layer of `module`, each once (a tied LM head included), in forward order."""
    seen: set[int] = set()
    layers = []
    for layer in module.modules():
        if id(layer) not in seen and packable(layer):
            seen.add(id(layer))
            layers.append(layer)
    return layers


def stack_seconds(layers: list[nn.Linear], hiddens: dict[int, torch.Tensor], pack_rows: int | None) -> float:
    """One product through every layer in turn, each over `hiddens[in_features]` (rows, in), as a forward streams
    its weights from memory: the default path (`pack_rows` None) or packs laid out for `pack_rows` (made on first
    use and kept on the layers)."""
    start = time.perf_counter()
    for layer in layers:
        hidden = hiddens[layer.in_features]
        if pack_rows is not None:
            pack = packed_weight(layer, pack_rows)
            onednn_product(hidden, pack, layer.bias)
        else:
            nn.functional.linear(hidden, layer.weight, layer.bias)
    return time.perf_counter() - start


def pays_at(layers: list[nn.Linear], rows: int, pack_rows: int, repeats: int) -> bool:
    """Whether the packed stack of `layers` (laid out for `pack_rows`) runs `rows`-row products >= `PAYS_FROM`
    times faster than the default path: both timed in turn, best of `repeats`, once per process."""
    dtype = layers[0].weight.dtype
    shapes = tuple((layer.out_features, layer.in_features, layer.bias is not None) for layer in layers)
    key = (dtype, shapes, rows, pack_rows, torch.get_num_threads())
    if key not in _PAYS:
        hiddens = {size: torch.randn(rows, size, dtype=dtype) for size in {layer.in_features for layer in layers}}
        with torch.no_grad():
            stack_seconds(layers, hiddens, pack_rows), stack_seconds(layers, hiddens, None)
            default = packed = float("inf")
            for _ in range(repeats):
                default = min(default, stack_seconds(layers, hiddens, None))
                packed = min(packed, stack_seconds(layers, hiddens, pack_rows))
        _PAYS[key] = default >= PAYS_FROM * packed
    return _PAYS[key]


def packing_floor(module: nn.Module, rows: int = PACK_ROWS, repeats: int = 3) -> int | None:
    """The fewest rows from which packing makes `module`'s linear layers faster on this machine, or None where it
    does not pay at `rows` (a verification round's width). Every packable layer's product, one after another as a
    forward runs them (weights streamed from memory: one layer warm in cache flattered packing where the whole
    forward did not gain), timed both ways at `rows`, then at 1 and 4 rows until it pays (on an Intel Xeon MKL's
    fp32 sgemm beats the pack at 1-2 rows and loses from 4). ~0.2-0.6 s once per dtype, shapes, rows and thread
    count in a process for a 135 M model, beside making the packs (~0.5 s), which a call that packs makes anyway;
    the packs stay on the layers where it pays and are freed where not."""
    layers = packable_layers(module)
    if not layers or len({layer.weight.dtype for layer in layers}) != 1:
        return None
    if not pays_at(layers, rows, rows, repeats):
        release_packed_weights(*layers)
        return None
    return next((probe for probe in FLOOR_PROBES if probe < rows and pays_at(layers, probe, rows, repeats)), rows)


def packing_pays(module: nn.Module, rows: int = PACK_ROWS) -> bool:
    """Whether packing makes `module`'s `rows`-row products faster on this machine (`packing_floor`)."""
    return packing_floor(module, rows) is not None
