"""The cost curve: one forward of n tokens, eager vs static cache vs compiled, fp32 vs bf16, beside the
machine's memory and compute limits.

For each dtype (`--dtypes`) and each n in `--tokens` (default 1, 2, 4, 8, 16, 32), after a warm
`--context`-token cache (default `VERIFICATION_CONTEXT`, where the loop's cost model times verification):

- target, `eager`: the forward our loop runs today (DynamicCache, cropped back after each pass, with the
  hidden states the drafter reads);
- target, `packed`: the eager forward with its linear layers through oneDNN over weights prepacked for
  8 rows (`hf_dflash.packed_linears`, what our loop's `drafter.linear_packing = "auto"` runs where it pays);
- target, `static`: the same forward over a `StaticCache` (its write position rewound after each pass, the
  slots overwritten by the next), eager: what a static cache alone costs or saves;
- target, `compiled`: that static forward through `torch.compile` (inductor, `--compile-mode`; `--freezing`:
  the weights become constants its GEMMs may pre-pack), one graph per n, compile time reported apart;
- target, `compiled packed`: the same compiled forward inside `packed_linears` (every product from one row through
  the packed op, as compiled verification runs the products at or above its packing floor);
- drafter, `eager`, `packed` and `compiled`: one draft pass over a k-token block with its k context features and
  the LM head on the k-1 draft slots (its cache cropped back), as a round drafts.

Each row is the median of `--reps` calls timed in turn over n (after one warm-up call per n), beside the
machine's limit for that forward: max(bytes read / measured memory bandwidth, FLOPs / measured GEMM
peak of the dtype), where the bytes are the weights a forward reads once (the tied LM head included)
plus the cached keys/values it attends to, and the FLOPs 2 x weights x n plus attention. `--slots`
also times a compiled decoding step (n = 1) over static caches of other sizes: a static cache attends
over every slot, where a dynamic one holds only the tokens so far.

    python benchmarks/generation/cost_curve.py --out out/cost_curve.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import DynamicCache, StaticCache

from hf_dflash.checkpoints import load_drafter
from hf_dflash.dtypes import cpu_flags
from hf_dflash.generation.policies.cost_timing import VERIFICATION_CONTEXT
from hf_dflash.json_files import write_json_atomic
from hf_dflash.packed_linears import packed_linears
from hf_dflash.targets import load_target

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ---------------------------------------------------------------- the machine's limits


def best_seconds(run: Callable[[], object], reps: int) -> float:
    run()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def memory_bandwidth(mebibytes: int = 512, reps: int = 5) -> float:
    """Bytes per second a full reduction reads (fp32 sum over `mebibytes`, best of `reps`)."""
    data = torch.ones(mebibytes * 2**20 // 4)
    return data.numel() * 4 / best_seconds(data.sum, reps)


def gemm_peak(dtype: torch.dtype, size: int = 2048, reps: int = 3) -> float:
    """FLOP per second of a square `size` matrix product in `dtype` (best of `reps`)."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    return 2 * size**3 / best_seconds(lambda: a @ b, reps)


def weight_elements(model: torch.nn.Module, embedding: torch.nn.Module, tied: bool) -> int:
    """Weights one forward reads: every parameter once (the input embedding only as a tied LM head)."""
    total = sum(parameter.numel() for parameter in model.parameters())
    return total if tied else total - embedding.weight.numel()


def attention_shape(config) -> tuple[int, int, int, int]:
    """(layers, query heads, key/value heads, head dim) of a decoder config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, heads, getattr(config, "num_key_value_heads", heads), head_dim


def forward_work(weights: int, config, n: int, context: int, element_bytes: int) -> tuple[int, int]:
    """(bytes read, FLOPs) of one forward of n tokens after `context` cached tokens."""
    layers, heads, kv_heads, head_dim = attention_shape(config)
    cache_bytes = layers * 2 * kv_heads * head_dim * (context + n) * element_bytes
    flops = 2 * weights * n + 4 * layers * heads * head_dim * n * (context + n)
    return weights * element_bytes + cache_bytes, flops


# ---------------------------------------------------------------- the forwards


def median_in_turn(run: Callable[[int], None], sizes, reps: int) -> dict[int, float]:
    """Median seconds of `run(n)` per n: one warm-up call each, then `reps` rounds over all sizes."""
    for n in sizes:
        run(n)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(reps):
        for n in sizes:
            start = time.perf_counter()
            run(n)
            times[n].append(time.perf_counter() - start)
    return {n: statistics.median(values) for n, values in times.items()}


def compile_each(function: Callable, sizes, run: Callable[[Callable, int], None], mode: str) -> tuple[dict, dict]:
    """One `torch.compile` graph per size (a fresh compiled callable each, so no size recompiles another's).
    Returns ({n: compiled callable}, {n: seconds of its first call, the compile})."""
    compiled, compile_seconds = {}, {}
    for n in sizes:
        compiled[n] = torch.compile(function, dynamic=False, mode=mode)
        start = time.perf_counter()
        run(compiled[n], n)
        compile_seconds[n] = time.perf_counter() - start
    return compiled, compile_seconds


def target_curves(target, layer_ids, tokens, context: int, reps: int, compile_mode: str | None, slot_counts) -> dict:
    """Eager, packed, static and (`compile_mode` not "none") compiled forwards of n tokens after `context`."""
    hidden_request = [i + 1 for i in layer_ids]
    vocab = target.get_input_embeddings().num_embeddings
    ids = (torch.arange(context + max(tokens)) * 7919 % vocab)[None]

    dynamic = DynamicCache(config=target.config)
    target(input_ids=ids[:, :context], cache=dynamic, use_cache=True)

    def eager(n: int) -> None:
        target(
            input_ids=ids[:, context : context + n], cache=dynamic, use_cache=True, output_hidden_states=hidden_request
        )
        dynamic.crop(-n)

    def static_pass(forward: Callable, n: int, cache: StaticCache) -> None:
        positions = torch.arange(context, context + n)
        forward(
            input_ids=ids[:, context : context + n],
            cache=cache,
            cache_position=positions,
            position_ids=positions[None],
            use_cache=True,
            output_hidden_states=hidden_request,
        )
        cache.crop(-n)  # rewinds the write position (Transformers 5.24 writes at the cache's own length)

    def prefilled_static(slots: int) -> StaticCache:
        cache = StaticCache(config=target.config, max_cache_len=slots)
        positions = torch.arange(context)
        target(input_ids=ids[:, :context], cache=cache, cache_position=positions, use_cache=True)
        return cache

    slots = context + max(tokens)
    static = prefilled_static(slots)
    curves = {"eager": median_in_turn(eager, tokens, reps)}
    with packed_linears(target, rows=8):
        curves["packed"] = median_in_turn(eager, tokens, reps)
    curves["static"] = median_in_turn(lambda n: static_pass(target.forward, n, static), tokens, reps)
    if compile_mode == "none":
        return {"seconds": curves, "static_slots": slots}
    compiled, compile_seconds = compile_each(
        target.forward, tokens, lambda f, n: static_pass(f, n, static), compile_mode
    )
    curves["compiled"] = median_in_turn(lambda n: static_pass(compiled[n], n, static), tokens, reps)
    with packed_linears(target, rows=8):  # the packed products as one op each in the graph (`packed_linear`)
        packed, packed_compile_seconds = compile_each(
            target.forward, tokens, lambda f, n: static_pass(f, n, static), compile_mode
        )
        curves["compiled packed"] = median_in_turn(lambda n: static_pass(packed[n], n, static), tokens, reps)
    decode_by_slots, slot_compile_seconds = {}, {}
    for count in slot_counts:
        cache = prefilled_static(count)
        step, seconds = compile_each(
            target.forward, (1,), lambda f, n, cache=cache: static_pass(f, n, cache), compile_mode
        )
        decode_by_slots[count] = median_in_turn(
            lambda n, cache=cache, step=step: static_pass(step[n], n, cache), (1,), reps
        )[1]
        slot_compile_seconds[count] = seconds[1]
    return {
        "seconds": curves,
        "compile_seconds": compile_seconds,
        "compile_seconds_packed": packed_compile_seconds,
        "static_slots": slots,
        "compiled_decode_by_slots": decode_by_slots,
        "compiled_decode_by_slots_compile_seconds": slot_compile_seconds,
    }


def drafter_curves(target, drafter, tokens, context: int, reps: int, compile_mode: str) -> dict:
    embedding, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    width = len(drafter.config.target_layer_ids) * target.config.hidden_size
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(1, context + max(tokens), width, generator=generator).to(drafter.dtype)
    cache = DynamicCache(config=drafter.config)  # as `BlockDrafter` keeps it
    drafter(
        noise_embeds=embedding(torch.zeros(1, 1, dtype=torch.long)),
        context_hidden_states=features[:, :context],
        position_ids=torch.arange(context + 1)[None],
        cache=cache,
    )
    cache.crop(-1)  # `context` injected features cached, as after a prompt
    block = torch.full((1, max(tokens)), drafter.config.mask_token_id)
    block[:, 0] = 1

    def draft(forward: Callable, k: int) -> None:
        hidden = forward(
            noise_embeds=embedding(block[:, :k]),
            context_hidden_states=features[:, context : context + k],
            position_ids=torch.arange(context, context + 2 * k)[None],
            attention_mask=torch.ones(1, context + 2 * k, dtype=torch.long),
            cache=cache,
        ).last_hidden_state
        drafter.greedy_draft_tokens(hidden[:, 1:], lm_head)
        cache.crop(-2 * k)

    curves = {"eager": median_in_turn(lambda k: draft(drafter.forward, k), tokens, reps)}
    with packed_linears(drafter, rows=8):
        curves["packed"] = median_in_turn(lambda k: draft(drafter.forward, k), tokens, reps)
    if compile_mode == "none":
        return {"seconds": curves}
    compiled, compile_seconds = compile_each(drafter.forward, tokens, draft, compile_mode)
    curves["compiled"] = median_in_turn(lambda k: draft(compiled[k], k), tokens, reps)
    return {"seconds": curves, "compile_seconds": compile_seconds}


# ---------------------------------------------------------------- report


def limits_ms(weights: int, config, tokens, context: int, element_bytes: int, bandwidth: float, peak: float) -> dict:
    out = {}
    for n in tokens:
        read, flops = forward_work(weights, config, n, context, element_bytes)
        out[n] = 1000 * max(read / bandwidth, flops / peak)
    return out


def print_table(name: str, model: str, curves: dict, limit: dict[int, float]) -> None:
    modes = list(curves)
    print(f"\n{model}, {name}: ms per forward (median), and the machine's limit")
    print("| n | " + " | ".join(modes) + " | limit | " + " | ".join(f"{m} / limit" for m in modes) + " |")
    print("|---" * (2 * len(modes) + 2) + "|")
    for n, bound in limit.items():
        values = [1000 * curves[mode][n] for mode in modes]
        print(
            f"| {n} | "
            + " | ".join(f"{v:.1f}" for v in values)
            + f" | {bound:.1f} | "
            + " | ".join(f"{v / bound:.1f}×" for v in values)
            + " |"
        )
    decode = {mode: curves[mode][min(limit)] for mode in modes}
    for n in (8, 16):
        if n in limit:
            print(f"n={n} / same path's n=1: " + ", ".join(f"{m} {curves[m][n] / decode[m]:.2f}×" for m in modes))


def parse_ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part)


@torch.inference_mode()
def main(args: argparse.Namespace) -> None:
    import torch._inductor.config as inductor_config

    # Freezing folds the weights into the graph as constants (its GEMM templates may pre-pack them), and with
    # them every static-address input: a StaticCache's buffers and length (torch 2.13). Safe here, where each
    # graph keeps its cache; not in `generate`, which makes a new cache per call: the second call's compiled
    # steps read and write the first call's cache (measured: DFlash τ 2.00 -> 1.29, then an index error).
    inductor_config.freezing = args.freezing
    torch._dynamo.config.recompile_limit = 64
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"cost_curve.py: error: {out} exists; choose another --out or remove it")
    tokens = args.tokens
    bandwidth = memory_bandwidth()
    result = {"machine": {}, "settings": {**vars(args)}, "dtypes": {}}
    for name in args.dtypes:
        dtype = DTYPES[name]
        target, _ = load_target(dtype=dtype)
        drafter = load_drafter(args.drafter, dtype=dtype).eval()
        peak = gemm_peak(dtype)
        element_bytes = torch.finfo(dtype).bits // 8
        tied = bool(getattr(target.config, "tie_word_embeddings", False))
        target_weights = weight_elements(target, target.get_input_embeddings(), tied)
        # the drafter reads its own layers and the LM head rows of its draft vocabulary
        head_rows = drafter.config.draft_vocab_size or target.config.vocab_size
        drafter_weights = sum(p.numel() for p in drafter.parameters()) + head_rows * target.config.hidden_size
        layer_ids = list(drafter.config.target_layer_ids)
        target_run = target_curves(target, layer_ids, tokens, args.context, args.reps, args.compile_mode, args.slots)
        drafter_run = drafter_curves(target, drafter, tokens, args.context, args.reps, args.compile_mode)
        target_limit = limits_ms(target_weights, target.config, tokens, args.context, element_bytes, bandwidth, peak)
        # draft pass over k tokens: 2k query rows (context features + block) of the drafter, k-1 head rows
        drafter_limit = limits_ms(drafter_weights, drafter.config, tokens, args.context, element_bytes, bandwidth, peak)
        result["dtypes"][name] = {
            "gemm_peak_gflops": round(peak / 1e9, 1),
            "target": {**target_run, "limit_ms": target_limit, "weights": target_weights},
            "drafter": {**drafter_run, "limit_ms": drafter_limit, "weights": drafter_weights},
        }
        print_table(name, "target", target_run["seconds"], target_limit)
        if "compile_seconds" in target_run:
            print("compile s per n: " + ", ".join(f"{n}: {s:.1f}" for n, s in target_run["compile_seconds"].items()))
        for count, seconds in target_run.get("compiled_decode_by_slots", {}).items():
            print(f"compiled decode step over {count} static slots: {1000 * seconds:.1f} ms")
        print_table(name, "drafter", drafter_run["seconds"], drafter_limit)
        del target, drafter
    flags = cpu_flags() or frozenset()
    result["machine"] = {
        "processor": platform.processor() or platform.machine(),
        "native_bf16": bool({"avx512_bf16", "amx_bf16"} & flags),
        "avx512": "avx512f" in flags,
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY") or "default",
        "torch": torch.__version__,
        "memory_bandwidth_gbs": round(bandwidth / 1e9, 1),
    }
    print(f"\nmemory bandwidth {bandwidth / 1e9:.1f} GB/s; GEMM peak " + ", ".join(
        f"{name} {row['gemm_peak_gflops']} GFLOP/s" for name, row in result["dtypes"].items()))  # fmt: skip
    write_json_atomic(out, result)
    print(f"wrote {out}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default="models/smollm2-135m-instruct-dflash")
    parser.add_argument("--dtypes", type=lambda text: text.split(","), default=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=parse_ints, default=(1, 2, 4, 8, 16, 32))
    parser.add_argument("--context", type=int, default=VERIFICATION_CONTEXT)
    parser.add_argument("--slots", type=parse_ints, default=(512, 2048), help="compiled decode step over these")
    parser.add_argument(
        "--compile-mode",
        default=None,
        help="torch.compile mode (default: inductor's default; 'none': no compiled rows)",
    )
    parser.add_argument("--freezing", action="store_true", help="inductor freezing (weights as constants)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default="out/cost_curve.json")
    return parser.parse_args()


if __name__ == "__main__":
    main(parse_args())
