"""Does a static cache with `torch.compile` pay on this machine? Plain decoding eager vs compiled, beside DFlash.

For each dtype, on the same chat prompts (`--sets`, `--num-prompts` each), greedy, `--max-new-tokens`:

- `plain`: `generate` as users call it (DynamicCache, eager);
- `plain-compiled`: a StaticCache of `STATIC_CACHE_LENGTH` slots and Transformers' own compiled decoding step
  (`compile_config`, forced on CPU);
- `dflash`: our loop with the shipped drafter at a fixed block (`--block-size`, default the drafter's).

A compiled verification forward in our loop was measured with commit ed7e7bd (reverted: τ fell and it was
slower; docs/results/generation/compiled_decoding_experiment.json).

Methods alternate per prompt (order rotated). Each method's first calls (the first prompt, untimed, at full
length and at 4 tokens: the block's verification length and the shorter ones of a generation's last rounds)
pay its compile and are reported apart (`warmup_s`). Every output is compared with `plain` token for token.

    python benchmarks/generation/compiled_decoding.py --num-prompts 1 --out out/compiled_decoding.json
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch
from transformers import CompileConfig, StaticCache

from hf_dflash.bench.prompts import load_prompt_sets
from hf_dflash.bench.runner import chat_inputs, rotated
from hf_dflash.caches import cache_keyword
from hf_dflash.checkpoints import load_drafter
from hf_dflash.dtypes import cpu_flags
from hf_dflash.json_files import write_json_atomic
from hf_dflash.models import load_target

METHODS = ("plain", "plain-compiled", "dflash")
STATIC_CACHE_LENGTH = 1024
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def compile_config() -> CompileConfig:
    config = CompileConfig(dynamic=False)
    config._compile_all_devices = True  # transformers 5.24 compiles generate's step on accelerators only
    return config


def method_kwargs(method: str, target, drafter) -> dict:
    kwargs = {"assistant_model": drafter} if method.startswith("dflash") else {}
    if method == "plain-compiled":
        cache = StaticCache(config=target.config, max_cache_len=STATIC_CACHE_LENGTH)
        kwargs |= {cache_keyword(target): cache, "compile_config": compile_config()}
    return kwargs


def timed(target, inputs, settings, kwargs) -> tuple[torch.LongTensor, float]:
    start = time.perf_counter()
    sequences = target.generate(**inputs, **settings, **kwargs)
    return sequences, time.perf_counter() - start


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default="models/smollm2-135m-instruct-dflash")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--sets", default="gsm8k,humaneval,mt-bench")
    parser.add_argument("--num-prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--out", default="out/compiled_decoding.json")
    args = parser.parse_args()
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"compiled_decoding.py: error: {out} exists; choose another --out or remove it")
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True  # weights as constants: inductor may pre-pack them for its GEMMs
    torch._dynamo.config.recompile_limit = 64
    prompt_sets = load_prompt_sets(args.sets.split(","), num_prompts=args.num_prompts)
    prompts = [record["messages"][:1] for records in prompt_sets.values() for record in records]
    results: dict = {"dtypes": {}}
    for name in args.dtypes.split(","):
        target, tokenizer = load_target(dtype=DTYPES[name])
        drafter = load_drafter(args.drafter, dtype=DTYPES[name]).eval()
        drafter.block_size_policy = args.block_size or drafter.config.block_size
        settings = {"do_sample": False, "max_new_tokens": args.max_new_tokens, "pad_token_id": tokenizer.eos_token_id}
        warm = chat_inputs(tokenizer, prompts[0], target.device)
        warmup_s = {}
        for method in METHODS:
            kwargs = method_kwargs(method, target, drafter)
            warmup_s[method] = timed(target, warm, settings, kwargs)[1]
            kwargs = method_kwargs(method, target, drafter)
            warmup_s[method] += timed(target, warm, {**settings, "max_new_tokens": 4}, kwargs)[1]
        tokens = dict.fromkeys(METHODS, 0)
        seconds = dict.fromkeys(METHODS, 0.0)
        identical = dict.fromkeys(METHODS, True)
        accepted: dict[str, list[int]] = {"dflash": []}
        for index, messages in enumerate(prompts):
            inputs = chat_inputs(tokenizer, messages, target.device)
            runs = {}
            for method in rotated(METHODS, index):
                runs[method] = timed(target, inputs, settings, method_kwargs(method, target, drafter))
                if method in accepted:
                    accepted[method] += drafter.last_acceptance.acceptance_lengths
            for method, (sequences, spent) in runs.items():
                tokens[method] += sequences.shape[1] - inputs["input_ids"].shape[1]
                seconds[method] += spent
                identical[method] &= torch.equal(sequences, runs["plain"][0])
        rates = {method: tokens[method] / seconds[method] for method in METHODS}
        fastest_plain = max(rates["plain"], rates["plain-compiled"])
        results["dtypes"][name] = {
            method: {
                "tok_s": round(rates[method], 2),
                "speedup_vs_fastest_plain": round(rates[method] / fastest_plain, 3),
                "warmup_s": round(warmup_s[method], 1),
                "identical_to_plain": identical[method],
                "tau": round(sum(accepted[method]) / len(accepted[method]), 3) if method in accepted else None,
            }
            for method in METHODS
        }
    flags = cpu_flags() or frozenset()
    results["machine"] = {
        "processor": platform.processor() or platform.machine(),
        "native_bf16": bool({"avx512_bf16", "amx_bf16"} & flags),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    results["settings"] = {**vars(args), "prompts": len(prompts), "static_cache_length": STATIC_CACHE_LENGTH}
    print("| dtype | method | tok/s | × fastest plain | τ | warm-up s | identical |\n|---|---|---|---|---|---|---|")
    for name, rows in results["dtypes"].items():
        for method, row in rows.items():
            tau = "-" if row["tau"] is None else f"{row['tau']:.2f}"
            print(
                f"| {name} | {method} | {row['tok_s']:.1f} | {row['speedup_vs_fastest_plain']:.2f}× | {tau} | "
                f"{row['warmup_s']:.1f} | {row['identical_to_plain']} |"
            )
    write_json_atomic(out, results)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
