"""Regeneration throughput: static left-padded `generate` batches vs continuous batching.

Both paths produce the target's greedy replies to the same prompts (first user turn, chat template,
prompts <= --max-prompt-tokens); the table gives reply tokens per second, timed one after the other
on the same prompts. The prompts mix the training sources in equal shares (seeded).

    python benchmarks/regeneration_speed.py --num-prompts 64 --batch-size 32 --max-new-tokens 384 \
        --dtype bfloat16 --out out/regeneration_speed.json
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
from hf_dflash.models import load_target


def prompt_ids(tokenizer, count: int, max_prompt_tokens: int, seed: int) -> list[list[int]]:
    records = [record for name in TRAIN_SOURCES for record in load_source(name, limit=count)]
    random.Random(seed).shuffle(records)
    ids = []
    for record in records:
        text = tokenizer.apply_chat_template(record["messages"][:1], tokenize=False, add_generation_prompt=True)
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(tokens) <= max_prompt_tokens:
            ids.append(tokens)
        if len(ids) == count:
            break
    return sorted(ids, key=len, reverse=True)  # the pipeline's order: longest first


def static_batches(model, prompts, batch_size, **kwargs):
    return [reply for s in range(0, len(prompts), batch_size) for reply in generate_replies(model, prompts[s : s + batch_size], temperature=0.0, **kwargs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="out/regeneration_speed.json")
    args = parser.parse_args()

    model, tokenizer = load_target(dtype=args.dtype)
    prompts = prompt_ids(tokenizer, args.num_prompts, args.max_prompt_tokens, args.seed)
    common = dict(eos_ids=stop_ids(model, tokenizer), pad_id=tokenizer.pad_token_id, max_new_tokens=args.max_new_tokens)
    rows = []
    for name, run in (
        ("static generate batches", lambda: static_batches(model, prompts, args.batch_size, **common)),
        ("continuous batching", lambda: continuous_greedy_replies(model, prompts, batch_size=args.batch_size, **common)),
    ):
        start = time.perf_counter()
        replies = run()
        seconds = time.perf_counter() - start
        tokens = sum(map(len, replies))
        rows.append({"method": name, "reply_tokens": tokens, "seconds": round(seconds, 1), "tokens_per_s": round(tokens / seconds, 1)})
        print(f"{name:>24}: {tokens} reply tokens in {seconds:.1f} s = {tokens / seconds:.1f} tok/s", flush=True)
    speedup = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    print(f"continuous / static: {speedup:.2f}x")
    result = {
        "settings": vars(args),
        "machine": {"processor": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "results": rows,
        "speedup": round(speedup, 2),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
