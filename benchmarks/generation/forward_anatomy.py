"""A verification forward taken apart: where an n-token target forward's time goes beyond the linear layers' limit.

The cost curve (`cost_curve.py`) times whole forwards; this script times their parts, in one dtype (default
float32, the proxy for CPUs without native bf16), for each n in `--tokens`:

- **linear stack**: every linear layer of the target once, in forward order (weights streamed from memory, as a
  forward reads them), over n rows: the default aten product (`default`), oneDNN over weights prepacked for 8
  rows (`packed`, what our loop runs where it pays: `hf_dflash.packed_linears`) and, with `--autotune`, the stack
  compiled by inductor with freezing and max-autotune over its C++ GEMM template and aten (`frozen autotune`: the
  weights as constants it packs for its own micro-kernels; ~40 s of compile per n). Beside them the machine's
  figures: its memory bandwidth, its GEMM peak (a square product) and an n-row product over one MLP weight
  held in cache (`small-M GEMM`, GFLOP/s), from which `mem + compute` = weight bytes / bandwidth + FLOPs /
  small-M rate: the stack's time when loading weights and multiplying do not overlap;
- **attention**: one layer's SDPA of n queries over `--slots` cached keys with a float mask (a static cache's
  rounds): Transformers' path with a mask on CPU (5.25: `repeat_kv` copies the key/value heads up to the query
  heads, then SDPA) against SDPA's own grouped-query broadcast (`enable_gqa=True`), eager and compiled, and
  their largest difference (0: the same sums);
- **whole forward**: the compiled target forward over a static cache, with the hidden states the drafter
  reads, as Transformers runs it (`sdpa`) and with `TRANSFORMERS_SDPA_FORCE_GQA=1` (Transformers' own switch to
  the grouped-query broadcast), each variant compiled afresh (dynamo reset between them), timed as A, B, A.

Prints tables and writes JSON:

    python benchmarks/generation/forward_anatomy.py --out out/forward_anatomy.json [--autotune]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from cost_curve import DTYPES, gemm_peak, median_in_turn, memory_bandwidth, parse_ints
from transformers import StaticCache

from hf_dflash.bench.loading import machine_description
from hf_dflash.generation.policies.cost_timing import VERIFICATION_CONTEXT
from hf_dflash.json_files import write_json_atomic
from hf_dflash.packed_linears import packable_layers, release_packed_weights, stack_seconds
from hf_dflash.targets import load_target

GQA_SWITCH = "TRANSFORMERS_SDPA_FORCE_GQA"  # Transformers 5.25 reads it on every attention call
HIDDEN_LAYERS = [2, 9, 15, 21, 28]  # what verification asks for v6 (target_layer_ids 1, 8, 14, 20, 27, each + 1)


# ---------------------------------------------------------------- the linear layers


class LinearStack(torch.nn.Module):
    """Every linear layer of a model once, in forward order, each over the input of its width (a forward's weight
    traffic without the rest of the forward)."""

    def __init__(self, layers: list[torch.nn.Linear]):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return [layer(inputs[str(layer.in_features)]) for layer in self.layers]


def small_m_gflops(rows: int, weight: torch.Tensor, reps: int = 300) -> float:
    """GFLOP/s of `rows`-row products over `weight` (out, in) held in cache (mean of `reps` after a warm-up)."""
    hidden = torch.randn(rows, weight.shape[1], dtype=weight.dtype)
    for _ in range(10):
        hidden @ weight.T
    start = time.perf_counter()
    for _ in range(reps):
        hidden @ weight.T
    return 2 * rows * weight.numel() * reps / (time.perf_counter() - start) / 1e9


def linear_stack(target, tokens, reps: int, autotune: bool) -> dict:
    """ms per stack pass per n: default, packed (and frozen autotune), with the machine's small-M rates."""
    layers = packable_layers(target)
    dtype = layers[0].weight.dtype
    widths = {layer.in_features for layer in layers}
    inputs = {n: {width: torch.randn(n, width, dtype=dtype) for width in widths} for n in tokens}
    seconds = {
        "default": median_in_turn(lambda n: stack_seconds(layers, inputs[n], None), tokens, reps),
        "packed": median_in_turn(lambda n: stack_seconds(layers, inputs[n], 8), tokens, reps),
    }
    release_packed_weights(target)
    compile_seconds = {}
    if autotune:
        import torch._inductor.config as inductor_config

        stack = LinearStack(layers).eval()
        named = {n: {str(width): x[None] for width, x in inputs[n].items()} for n in tokens}
        with inductor_config.patch(freezing=True, max_autotune=True, max_autotune_gemm_backends="CPP,ATEN"):
            compiled = {}
            for n in tokens:
                compiled[n] = torch.compile(stack, dynamic=False)
                start = time.perf_counter()
                compiled[n](named[n])
                compile_seconds[n] = time.perf_counter() - start
            seconds["frozen autotune"] = median_in_turn(lambda n: compiled[n](named[n]), tokens, reps)
        torch._dynamo.reset()
    mlp_weight = max(layers[:-1], key=lambda layer: layer.weight.numel()).weight  # the largest but the LM head
    return {
        "ms": {mode: {n: 1000 * s for n, s in values.items()} for mode, values in seconds.items()},
        "compile_seconds": compile_seconds,
        "small_m_gflops": {n: small_m_gflops(n, mlp_weight.detach()) for n in tokens},
        "weight_bytes": sum(layer.weight.numel() * layer.weight.element_size() for layer in layers),
        "flops_per_row": 2 * sum(layer.weight.numel() for layer in layers),
    }


# ---------------------------------------------------------------- attention


def attention(config, dtype, tokens, slots: int, context: int, reps: int) -> dict:
    """µs of one layer's SDPA per n (repeat_kv + SDPA against enable_gqa; eager and compiled) and their largest
    difference."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    groups = heads // kv_heads
    keys, values = (torch.randn(1, kv_heads, slots, head_dim, dtype=dtype) for _ in range(2))

    def repeated(x: torch.Tensor) -> torch.Tensor:  # Transformers' repeat_kv
        return x[:, :, None].expand(1, kv_heads, groups, slots, head_dim).reshape(1, heads, slots, head_dim)

    def with_repeat(q, mask):
        return F.scaled_dot_product_attention(q, repeated(keys), repeated(values), attn_mask=mask)

    def with_gqa(q, mask):
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)

    queries, masks = {}, {}
    for n in tokens:
        queries[n] = torch.randn(1, heads, n, head_dim, dtype=dtype)
        visible = torch.arange(slots)[None] <= context + torch.arange(n)[:, None]  # causal over the cached slots
        masks[n] = torch.zeros(n, slots, dtype=dtype).masked_fill(~visible, torch.finfo(dtype).min)[None, None]
    variants = {"repeat_kv": with_repeat, "enable_gqa": with_gqa}
    variants |= {f"{name} compiled": torch.compile(f, dynamic=False) for name, f in list(variants.items())}
    microseconds = {}
    for name, function in variants.items():
        per_n = median_in_turn(lambda n, f=function: [f(queries[n], masks[n]) for _ in range(20)], tokens, reps)
        microseconds[name] = {n: 1e6 * s / 20 for n, s in per_n.items()}
    difference = {
        n: float((with_repeat(queries[n], masks[n]) - with_gqa(queries[n], masks[n])).abs().max()) for n in tokens
    }
    torch._dynamo.reset()
    return {"us_per_layer": microseconds, "max_abs_difference": difference, "layers": config.num_hidden_layers}


# ---------------------------------------------------------------- the whole forward


def whole_forward(target, tokens, slots: int, context: int, reps: int) -> dict:
    """ms of the compiled static-cache forward per n, Transformers' sdpa (A) against its GQA switch (B): A, B, A."""
    vocab = target.get_input_embeddings().num_embeddings
    ids = (torch.arange(context + max(tokens)) * 7919 % vocab)[None]
    cache = StaticCache(config=target.config, max_cache_len=slots)
    positions = torch.arange(context)
    # the hidden states requested once eagerly: Transformers installs its capturing hooks outside the graph
    target(input_ids=ids[:, :context], cache=cache, cache_position=positions, output_hidden_states=HIDDEN_LAYERS)

    def one_pass(forward, n: int) -> None:
        positions = torch.arange(context, context + n)
        forward(
            input_ids=ids[:, context : context + n],
            cache=cache,
            cache_position=positions,
            position_ids=positions[None],
            output_hidden_states=HIDDEN_LAYERS,
        )
        cache.crop(-n)

    runs = []
    for gqa in (False, True, False):
        torch._dynamo.reset()
        if gqa:
            os.environ[GQA_SWITCH] = "1"
        else:
            os.environ.pop(GQA_SWITCH, None)
        compiled = torch.compile(target.forward, dynamic=False)
        medians = median_in_turn(lambda n, compiled=compiled: one_pass(compiled, n), tokens, reps)
        runs.append(("gqa" if gqa else "sdpa", {n: 1000 * s for n, s in medians.items()}))
    os.environ.pop(GQA_SWITCH, None)
    torch._dynamo.reset()
    return {"runs": runs}


# ---------------------------------------------------------------- report


def print_report(result: dict) -> None:
    stack, machine = result["linear_stack"], result["machine"]
    bandwidth = machine["memory_bandwidth_gbs"] * 1e9
    print(f"\nlinear stack ({stack['weight_bytes'] / 1e6:.0f} MB of weights): ms per pass (median)")
    modes = list(stack["ms"])
    print("| n | " + " | ".join(modes) + " | small-M GEMM GFLOP/s | mem + compute ms |")
    print("|---" * (len(modes) + 3) + "|")
    for n in result["settings"]["tokens"]:
        rate = stack["small_m_gflops"][n]
        serial = 1000 * (stack["weight_bytes"] / bandwidth + n * stack["flops_per_row"] / (rate * 1e9))
        print(f"| {n} | " + " | ".join(f"{stack['ms'][m][n]:.1f}" for m in modes) + f" | {rate:.0f} | {serial:.1f} |")
    attention = result["attention"]
    print(f"\nattention: µs per layer (x {attention['layers']} layers), {result['settings']['slots']} slots")
    names = list(attention["us_per_layer"])
    print("| n | " + " | ".join(names) + " | max difference |")
    print("|---" * (len(names) + 2) + "|")
    for n in result["settings"]["tokens"]:
        row = " | ".join(f"{attention['us_per_layer'][name][n]:.0f}" for name in names)
        print(f"| {n} | {row} | {attention['max_abs_difference'][n]:.1e} |")
    print("\ncompiled forward (static cache, hidden states): ms (median), in the order run")
    runs = result["whole_forward"]["runs"]
    print("| n | " + " | ".join(name for name, _ in runs) + " |")
    print("|---" * (len(runs) + 1) + "|")
    for n in result["settings"]["tokens"]:
        print(f"| {n} | " + " | ".join(f"{ms[n]:.1f}" for _, ms in runs) + " |")
    print(
        f"\nmemory bandwidth {machine['memory_bandwidth_gbs']} GB/s, GEMM peak {machine['gemm_peak_gflops']} GFLOP/s "
        f"({result['settings']['dtype']}), {machine['threads']} threads"
    )


@torch.inference_mode()
def main(args: argparse.Namespace) -> None:
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"forward_anatomy.py: error: {out} exists; choose another --out or remove it")
    torch._dynamo.config.recompile_limit = 64
    dtype = DTYPES[args.dtype]
    target, _ = load_target(dtype=dtype)
    result = {
        "settings": {**vars(args), "tokens": list(args.tokens)},
        "machine": {
            "description": machine_description(torch.device("cpu")),
            "threads": torch.get_num_threads(),
            "memory_bandwidth_gbs": round(memory_bandwidth() / 1e9, 1),
            "gemm_peak_gflops": round(gemm_peak(dtype) / 1e9, 1),
        },
    }
    result["linear_stack"] = linear_stack(target, args.tokens, args.reps, args.autotune)
    result["attention"] = attention(target.config, dtype, args.tokens, args.slots, args.context, args.reps)
    result["whole_forward"] = whole_forward(target, args.tokens, args.slots, args.context, args.reps)
    print_report(result)
    write_json_atomic(out, result)
    print(f"wrote {out}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--tokens", type=parse_ints, default=(1, 8, 18))
    parser.add_argument("--context", type=int, default=VERIFICATION_CONTEXT)
    parser.add_argument("--slots", type=int, default=512, help="static cache slots the forward attends over")
    parser.add_argument("--autotune", action="store_true", help="also the stack frozen + max-autotune (slow)")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--out", default="out/forward_anatomy.json")
    return parser.parse_args()


if __name__ == "__main__":
    main(parse_args())
