"""Regeneration throughput: static left-padded `generate` batches vs continuous batching, by batch size.

Every path produces the target's greedy replies to the same prompts (first user turn, chat template,
prompts <= --max-prompt-tokens); the table gives reply tokens per second, timed one after the other
on the same prompts. The prompts mix the training sources in equal shares (seeded).

    python benchmarks/data/regeneration_speed.py --num-prompts 64 --batch-sizes 32 --max-new-tokens 384 \
        --dtype bfloat16 --out out/regeneration_speed.json
    # batch size by measurement, continuous batching only, one torch thread (as a background job runs):
    python benchmarks/data/regeneration_speed.py --methods continuous --batch-sizes 32,96 --num-prompts 192 \
        --threads 1 --max-new-tokens 256
    # what long prompts cost: the same run on a length band (rendered prompt tokens in [min, max])
    python benchmarks/data/regeneration_speed.py --methods continuous --batch-sizes 64 --num-prompts 32 \
        --min-prompt-tokens 513 --max-prompt-tokens 2560 --max-new-tokens 512
"""

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

from hf_dflash.data.continuous import continuous_greedy_replies
from hf_dflash.data.regenerate import generate_replies, stop_ids
from hf_dflash.data.sources import TRAIN_SOURCES, load_source
from hf_dflash.targets import load_target


def prompt_ids(tokenizer, count: int, max_prompt_tokens: int, seed: int, min_prompt_tokens: int = 0) -> list[list[int]]:
    """`count` rendered first turns of min_prompt_tokens..max_prompt_tokens tokens, longest first. A band above the
    shortest prompts reads every source whole (long prompts are a few percent of them)."""
    limit = count if min_prompt_tokens == 0 else None
    records = [record for name in TRAIN_SOURCES for record in load_source(name, limit=limit)]
    random.Random(seed).shuffle(records)
    ids = []
    for record in records:
        text = tokenizer.apply_chat_template(record["messages"][:1], tokenize=False, add_generation_prompt=True)
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        if min_prompt_tokens <= len(tokens) <= max_prompt_tokens:
            ids.append(tokens)
        if len(ids) == count:
            break
    return sorted(ids, key=len, reverse=True)  # the pipeline's order: longest first


METHODS = {"static": "static generate batches", "continuous": "continuous batching"}


def static_batches(model, prompts, batch_size, **kwargs):
    return [
        reply
        for s in range(0, len(prompts), batch_size)
        for reply in generate_replies(model, prompts[s : s + batch_size], temperature=0.0, **kwargs)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--batch-sizes", default="32", help="comma-separated rows per batch (default: %(default)s)")
    parser.add_argument("--methods", default="static,continuous", help="comma-separated, from: static,continuous")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--min-prompt-tokens", type=int, default=0, help="a length band's lower end (default: none)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="out/regeneration_speed.json")
    args = parser.parse_args()
    batch_sizes = [int(size) for size in args.batch_sizes.split(",")]
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or any(size < 1 for size in batch_sizes):
        parser.error(
            f"--methods must come from {','.join(METHODS)} and --batch-sizes be positive, got {args.methods!r}, {args.batch_sizes!r}"
        )
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_target(dtype=args.dtype)
    prompts = prompt_ids(tokenizer, args.num_prompts, args.max_prompt_tokens, args.seed, args.min_prompt_tokens)
    if len(prompts) < args.num_prompts:
        parser.error(f"only {len(prompts)} prompts of {args.min_prompt_tokens}-{args.max_prompt_tokens} tokens")
    common = dict(eos_ids=stop_ids(model, tokenizer), pad_id=tokenizer.pad_token_id, max_new_tokens=args.max_new_tokens)
    runs = {
        "static": lambda size: static_batches(model, prompts, size, **common),
        "continuous": lambda size: continuous_greedy_replies(model, prompts, batch_size=size, **common),
    }
    rows = []
    for method in methods:
        for size in batch_sizes:
            start = time.perf_counter()
            replies = runs[method](size)
            seconds = time.perf_counter() - start
            tokens = sum(map(len, replies))
            rows.append(
                {
                    "method": METHODS[method],
                    "batch_size": size,
                    "prompts": len(prompts),
                    "prompt_tokens": sum(map(len, prompts)),
                    "reply_tokens": tokens,
                    "seconds": round(seconds, 1),
                    "tokens_per_s": round(tokens / seconds, 1),
                    "prompts_per_s": round(len(prompts) / seconds, 3),
                }
            )
            print(
                f"{METHODS[method]:>24} batch {size:>3}: {len(prompts)} prompts, {tokens} reply tokens in {seconds:.1f} s = "
                f"{tokens / seconds:.1f} tok/s, {len(prompts) / seconds:.3f} prompts/s",
                flush=True,
            )
    slowest = min(row["tokens_per_s"] for row in rows)
    for row in rows:
        row["speedup_over_slowest"] = round(row["tokens_per_s"] / slowest, 2)
    print("\n| method | batch | tok/s | prompts/s | vs slowest |\n|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['method']} | {row['batch_size']} | {row['tokens_per_s']} | {row['prompts_per_s']} "
            f"| {row['speedup_over_slowest']:.2f}x |"
        )
    result = {
        "settings": vars(args),
        "machine": {"processor": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "results": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
