"""The cost curve: one target forward over n tokens, eager vs compiled, per dtype, beside the machine's limits.

For each dtype (float32, bfloat16) and path, times one forward of n = 1, 2, 4, 8, 16, 32 new tokens after a
warm `--prefix`-token cache (a verification round's shape; the cache is rolled back after each call):

- `eager`: the model as the decoding loop runs it today (DynamicCache, cropped back);
- `compiled`: a StaticCache (rolled back by its length) and `torch.compile(model.forward)` with inductor,
  freezing (weights as constants) and `--mode`; one graph per n (`dynamic=False`). Compile seconds (the
  first two calls of each n) are reported apart, never inside the per-call times.

The limits beside them: bytes read per forward (the weights, the embedding excepted, plus the cache's
keys and values) over the measured memory bandwidth (a large copy), and FLOPs (2 per weight per token)
over the measured matmul peak of the dtype. Paths alternate inside every repetition so drift hits all
alike; the fastest of `--reps` calls is reported (other work only slows a call down).

    python benchmarks/generation/cost_curve.py --out docs/results/generation/cost_curve.json
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch
from transformers import DynamicCache, StaticCache

from hf_dflash.dtypes import cpu_flags
from hf_dflash.json_files import write_json_atomic
from hf_dflash.models import load_target

TOKENS = (1, 2, 4, 8, 16, 32)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def fastest(run, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def memory_bandwidth(megabytes: int = 512, reps: int = 5) -> float:
    """Bytes per second of a large copy (read + write counted)."""
    source = torch.empty(megabytes * 2**20, dtype=torch.uint8)
    target = torch.empty_like(source)
    target.copy_(source)
    return 2 * source.numel() / fastest(lambda: target.copy_(source), reps)


def matmul_peak(dtype: torch.dtype, size: int = 2048, reps: int = 5) -> float:
    """FLOP per second of a square matmul in `dtype`."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    a @ b
    return 2 * size**3 / fastest(lambda: a @ b, reps)


class ForwardPath:
    """One way to run the target: `forward(n)` runs n new tokens after the warm prefix and rolls back."""

    def __init__(self, model, ids: torch.LongTensor, prefix: int, compiled: bool, mode: str | None):
        self.model, self.ids, self.prefix = model, ids, prefix
        if compiled:
            self.cache = StaticCache(config=model.config, max_cache_len=prefix + max(TOKENS))
            model(ids[:, :prefix], cache=self.cache, use_cache=True)
            self.call = torch.compile(model.forward, mode=mode, dynamic=False)
        else:
            self.cache = DynamicCache(config=model.config)
            model(ids[:, :prefix], cache=self.cache, use_cache=True)
            self.call = model.forward
        self.compiled = compiled
        self.compile_seconds: dict[int, float] = {}

    def forward(self, n: int) -> None:
        self.call(input_ids=self.ids[:, self.prefix : self.prefix + n], cache=self.cache, use_cache=True)
        self.cache.crop(-n)  # a negative count removes the n new tokens (a StaticCache moves its length back)

    def warm_up(self, n: int) -> None:
        start = time.perf_counter()
        self.forward(n)
        self.forward(n)
        self.compile_seconds[n] = time.perf_counter() - start


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--prefix", type=int, default=300)
    parser.add_argument("--mode", default="max-autotune-no-cudagraphs", help="torch.compile mode ('default': None)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--out", default="out/cost_curve.json")
    args = parser.parse_args()
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"cost_curve.py: error: {out} exists; choose another --out or remove it")
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True  # weights become constants: inductor may pre-pack them for its GEMMs
    torch._dynamo.config.recompile_limit = 64  # one graph per (dtype, n): more than the default 8
    mode = None if args.mode == "default" else args.mode
    ids = (torch.arange(args.prefix + max(TOKENS)) * 7919 % 49152)[None]
    bandwidth = memory_bandwidth()
    results: dict = {"machine": {}, "dtypes": {}}
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        model = load_target("smollm2-135m-instruct", dtype=dtype)[0]
        weights = sum(p.numel() for n_, p in model.named_parameters() if "embed_tokens" not in n_)
        weights += model.config.vocab_size * model.config.hidden_size if model.config.tie_word_embeddings else 0
        kv_bytes_per_token = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads
        kv_bytes_per_token *= (model.config.hidden_size // model.config.num_attention_heads) * dtype.itemsize
        peak = matmul_peak(dtype)
        paths = {
            "eager": ForwardPath(model, ids, args.prefix, False, None),
            "compiled": ForwardPath(model, ids, args.prefix, True, mode),
        }
        for path in paths.values():
            for n in TOKENS:
                path.warm_up(n)
        times = {name_: {n: [] for n in TOKENS} for name_ in paths}
        for _ in range(args.reps):
            for n in TOKENS:
                for path_name, path in paths.items():
                    start = time.perf_counter()
                    path.forward(n)
                    times[path_name][n].append(time.perf_counter() - start)
        entry = {
            "matmul_peak_gflops": round(peak / 1e9, 1),
            "limit_ms": {},
            "paths": {},
        }
        for n in TOKENS:
            bytes_read = weights * dtype.itemsize + (args.prefix + n) * kv_bytes_per_token
            entry["limit_ms"][n] = round(1e3 * max(bytes_read / bandwidth, 2 * weights * n / peak), 2)
        for path_name, path in paths.items():
            entry["paths"][path_name] = {
                "ms": {n: round(1e3 * min(times[path_name][n]), 2) for n in TOKENS},
                "warm_up_s": {n: round(s, 1) for n, s in path.compile_seconds.items()},
            }
        results["dtypes"][name] = entry
        del paths, model
    flags = cpu_flags() or frozenset()
    results["machine"] = {
        "processor": platform.processor() or platform.machine(),
        "native_bf16": bool({"avx512_bf16", "amx_bf16"} & flags),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "memory_bandwidth_gbs": round(bandwidth / 1e9, 1),
        "mode": args.mode,
        "prefix": args.prefix,
    }
    print(f"memory bandwidth {bandwidth / 1e9:.1f} GB/s, torch {torch.__version__}, mode {args.mode}")
    header = "| dtype | path | " + " | ".join(f"{n} tok" for n in TOKENS) + " | n=8 / n=1 |"
    print(header + "\n|" + "---|" * (len(TOKENS) + 3))
    for name, entry in results["dtypes"].items():
        rows = {**{p: e["ms"] for p, e in entry["paths"].items()}, "limit": entry["limit_ms"]}
        for path_name, ms in rows.items():
            cells = " | ".join(f"{ms[n]:.1f}" for n in TOKENS)
            print(f"| {name} | {path_name} | {cells} | {ms[8] / ms[1]:.2f} |")
    write_json_atomic(out, results)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
