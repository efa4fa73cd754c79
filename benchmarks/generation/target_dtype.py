"""Is bfloat16 or float32 faster for the target on this machine? (SmolLM2-135M-Instruct, CPU)

Times, for each dtype, one verification forward over n = 1, 2, 4, 8, 16, 24, 32 new tokens after a
warm `--prefix`-token cache (with the 4D draft-tree mask and the drafter's hidden states, as hybrid
drafting verifies a tree; the cache is cropped back after each), and plain greedy `generate` per token
on a chat prompt. The dtypes alternate inside every repetition, so machine drift hits both alike;
medians are reported.

    python benchmarks/generation/target_dtype.py --reps 7 --out out/target_dtype.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from hf_dflash.generation.verifying.tree_verification import tree_attention_bias
from hf_dflash.targets import load_target

TOKENS = (1, 2, 4, 8, 16, 24, 32)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PROMPT = "Write a Python function that checks whether a string is a palindrome, then explain it."
LAYERS = [2, 9, 15, 21, 28]  # the hidden states a 5-feature drafter reads from SmolLM2's 30 layers


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--prefix", type=int, default=300)
    parser.add_argument("--new-tokens", type=int, default=48, help="plain generate: tokens per timed call")
    parser.add_argument("--out", default="out/target_dtype.json")
    args = parser.parse_args()

    models = {name: load_target("smollm2-135m-instruct", dtype=dtype)[0] for name, dtype in DTYPES.items()}
    tokenizer = load_target("smollm2-135m-instruct", dtype=torch.float32)[1]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)  # fmt: skip
    ids = (torch.arange(args.prefix + max(TOKENS)) * 7919 % 49152)[None]
    caches = {}
    for name, model in models.items():
        caches[name] = DynamicCache(config=model.config)
        model(ids[:, : args.prefix], cache=caches[name], use_cache=True)
    forward = {name: {n: [] for n in TOKENS} for name in models}
    decode = {name: [] for name in models}
    for rep in range(args.reps + 1):  # repetition 0 warms up
        for n in TOKENS:
            for name, model in models.items():
                inputs = dict(
                    input_ids=ids[:, args.prefix : args.prefix + n],
                    attention_mask=tree_attention_bias(tuple(range(-1, n - 1)), args.prefix, model.dtype, model.device),
                    position_ids=torch.arange(args.prefix, args.prefix + n)[None],
                )
                start = time.perf_counter()
                model(**inputs, cache=caches[name], use_cache=True, output_hidden_states=LAYERS)
                elapsed = time.perf_counter() - start
                caches[name].crop(-n)
                if rep:
                    forward[name][n].append(elapsed)
        for name, model in models.items():
            start = time.perf_counter()
            model.generate(**chat, do_sample=False, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens)
            if rep:
                decode[name].append((time.perf_counter() - start) / args.new_tokens)

    result = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "prefix": args.prefix,
        "reps": args.reps,
        "forward_ms": {name: {n: 1000 * statistics.median(v) for n, v in per.items()} for name, per in forward.items()},
        "plain_generate_ms_per_token": {name: 1000 * statistics.median(v) for name, v in decode.items()},
    }
    print(f"target forward ms (median of {args.reps}), {args.prefix}-token prefix, {result['machine']}")
    print("tokens  " + "  ".join(f"{name:>9}" for name in models) + "  bf16/fp32")
    for n in TOKENS:
        values = [result["forward_ms"][name][n] for name in models]
        print(f"{n:>6}  " + "  ".join(f"{v:9.1f}" for v in values) + f"  {values[1] / values[0]:9.2f}")
    plain = result["plain_generate_ms_per_token"]
    print("plain generate ms/token  " + "  ".join(f"{name} {plain[name]:.1f}" for name in models))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"Wrote {args.out}")


if __name__ == "__main__":
    main()
