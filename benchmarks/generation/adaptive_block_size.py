"""Adaptive block size vs fixed block sizes, greedy, on SmolLM2-135M-Instruct (or another target).

Methods, on the same prompts, interleaved per prompt (or per batch) with the order rotated so machine
drift hits all of them alike (`hf_dflash.bench.runner.rotated`):

    plain      target.generate(...)
    k=4, k=8   drafter.block_size_policy = k         (each --block-sizes value below B)
    k=B        the drafter's trained block size (the default policy)
    adaptive   drafter.block_size_policy = AdaptiveBlockSize()   (cost model timed once, cached)

Prompts: the first user turn of `--num-prompts` records of each `--sets` evaluation set
(`hf_dflash.bench.prompts`), or the three prompts of `hf-dflash demo` (`--demo-prompts`); `--repeats` runs
them that many times. Prints tokens/s, τ (tokens committed per round), the mean block length,
the speed-up over plain and whether every output equals plain greedy; writes all of it as JSON.
In bf16 a k-token verification may round a near-tie differently from one-token plain decoding, so a
"NO" there is not necessarily a bug: `--dtype float32` must give "yes" everywhere.

    python benchmarks/generation/adaptive_block_size.py --drafter out/drafter
    python benchmarks/generation/adaptive_block_size.py --drafter out/drafter --batch-size 4 --out out/adaptive_b4.json
    python benchmarks/generation/adaptive_block_size.py --drafter random --sets gsm8k --num-prompts 1 --max-new-tokens 16
    python benchmarks/generation/adaptive_block_size.py --drafter models/smollm2-135m-instruct-dflash --demo-prompts \
        --block-sizes --max-new-tokens 128 --repeats 3      # the demo's prompts, 3 times: plain, k=B, adaptive
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hf_dflash import AdaptiveBlockSize
from hf_dflash.bench.loading import RANDOM_DRAFTER, load_bench_models, machine_description
from hf_dflash.bench.prompts import EVAL_SETS, load_prompt_sets
from hf_dflash.bench.runner import rotated
from hf_dflash.data.regenerate import render_conversation
from hf_dflash.demo import DEMO_PROMPTS
from hf_dflash.generation.policies.cost_timing import measured_cost_model
from hf_dflash.targets import DEFAULT_TARGET

WARMUP_TOKENS = 4


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafter", required=True, help="trained drafter folder (either format), or 'random'")
    parser.add_argument("--target", default=DEFAULT_TARGET, help="known target name or local folder")
    parser.add_argument("--sets", nargs="+", default=["gsm8k", "humaneval", "mt-bench"], choices=list(EVAL_SETS))
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--demo-prompts", action="store_true", help="the prompts of `hf-dflash demo` (not --sets)")
    parser.add_argument("--repeats", type=int, default=1, help="run every prompt this many times")
    parser.add_argument("--block-sizes", type=int, nargs="*", default=[4, 8], help="fixed k besides the trained B")
    parser.add_argument("--batch-size", type=int, default=1, help="> 1: left-padded batches (batched DFlash)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default=None, help="default: CUDA when available, else CPU")
    parser.add_argument("--seed", type=int, default=0, help="prompt sampling (and the random drafter)")
    parser.add_argument("--cost-cache-dir", default=None, help="cost model cache (default: the hf_dflash cache)")
    parser.add_argument("--out", default="out/adaptive_block_size.json")
    args = parser.parse_args(argv)
    if args.drafter != RANDOM_DRAFTER and not Path(args.drafter).is_dir():
        parser.error(f"--drafter {args.drafter!r} is not a folder; pass a trained drafter folder, or 'random'.")
    if args.batch_size < 1:
        parser.error(f"--batch-size must be >= 1, got {args.batch_size}.")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}.")
    return args


def policies(block_sizes: list[int], trained: int, cost_cache_dir) -> dict:
    """method name -> `drafter.block_size_policy` (None for plain decoding)."""
    wrong = [k for k in block_sizes if not 1 <= k <= trained]
    if wrong:
        raise SystemExit(f"--block-sizes {wrong} outside 1..{trained} (the drafter's block size).")
    fixed = {f"k={k}": k for k in sorted(set(block_sizes) - {trained})}
    return {"plain": None, **fixed, f"k={trained}": trained, "adaptive": AdaptiveBlockSize(cache_dir=cost_cache_dir)}


def demo_prompt_sets() -> dict:
    """{"demo": records} of the three prompts `hf-dflash demo` answers."""
    records = [{"id": name, "messages": [{"role": "user", "content": text}]} for name, text in DEMO_PROMPTS.items()]
    return {"demo": records}


def prompt_batches(tokenizer, prompt_sets: dict, batch_size: int, device) -> list[tuple[str, list[str], dict]]:
    """(set, record ids, left-padded `generate` inputs) per batch of first user turns (messages before
    the first user turn, e.g. a system message, included)."""
    tokenizer.padding_side = "left"
    batches = []
    for name, records in prompt_sets.items():
        texts, ids = [], []
        for record in records:
            first_user = next(i for i, m in enumerate(record["messages"]) if m["role"] == "user")
            messages = record["messages"][: first_user + 1]
            texts.append(render_conversation(tokenizer, messages, add_generation_prompt=True))  # base models too
            ids.append(record["id"])
        for start in range(0, len(texts), batch_size):
            inputs = tokenizer(
                texts[start : start + batch_size], return_tensors="pt", padding=True, add_special_tokens=False
            )
            batches.append((name, ids[start : start + batch_size], inputs.to(device)))
    return batches


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(target, drafter, policy, inputs: dict, settings: dict) -> tuple[torch.Tensor, float]:
    kwargs = {}
    if policy is not None:
        drafter.block_size_policy = policy
        kwargs["assistant_model"] = drafter
    synchronize(target.device)
    start = time.perf_counter()
    output = target.generate(**inputs, **settings, **kwargs)
    synchronize(target.device)
    return output, time.perf_counter() - start


def summarize(samples: list[dict], methods: list[str]) -> dict:
    """Per method: tokens/s over all samples (total tokens / total seconds), τ, mean k, speed-up, identical."""
    summary = {}
    for method in methods:
        mine = [s for s in samples if s["method"] == method]
        tokens, seconds = sum(s["new_tokens"] for s in mine), sum(s["seconds"] for s in mine)
        taus = [t for s in mine for t in s["acceptance_lengths"] or []]
        ks = [k for s in mine for k in s["block_sizes"] or []]
        checked = [s["identical"] for s in mine if s["identical"] is not None]
        summary[method] = {
            "new_tokens": tokens,
            "seconds": seconds,
            "tok_s": tokens / seconds if seconds else 0.0,
            "tau": sum(taus) / len(taus) if taus else None,
            "mean_block_size": sum(ks) / len(ks) if ks else None,
            "identical": all(checked) if checked else None,
        }
    plain = summary.get("plain", {}).get("tok_s")
    for values in summary.values():
        values["speedup"] = values["tok_s"] / plain if plain else None
    return summary


def print_table(summary: dict) -> None:
    print(f"{'method':16s} {'tok/s':>8s} {'tau':>6s} {'mean k':>7s} {'speedup':>8s}  identical")
    for method, v in summary.items():
        tau = f"{v['tau']:.2f}" if v["tau"] is not None else "-"
        mean_k = f"{v['mean_block_size']:.1f}" if v["mean_block_size"] is not None else "-"
        speedup = f"{v['speedup']:.2f}x" if v["speedup"] is not None else "-"
        identical = "-" if v["identical"] is None else ("yes" if v["identical"] else "NO")
        print(f"{method:16s} {v['tok_s']:8.1f} {tau:>6s} {mean_k:>7s} {speedup:>8s}  {identical}")


@torch.no_grad()
def main(argv=None) -> dict:
    args = parse_args(argv)
    models = load_bench_models(args.target, args.drafter, dtype=args.dtype, device=args.device, seed=args.seed)
    target, tokenizer, drafter = models.target, models.tokenizer, models.drafter
    methods = policies(args.block_sizes, drafter.config.block_size, args.cost_cache_dir)
    names = list(methods)
    if args.demo_prompts:
        prompt_sets = demo_prompt_sets()
    else:
        prompt_sets = load_prompt_sets(args.sets, num_prompts=args.num_prompts, seed=args.seed)
    batches = prompt_batches(tokenizer, prompt_sets, args.batch_size, target.device) * args.repeats
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    settings = {"do_sample": False, "max_new_tokens": args.max_new_tokens, "pad_token_id": pad_token_id}

    # The adaptive policy's cost model for every batch size here, timed (or loaded) before any timed run.
    cost_model = measured_cost_model(
        target, drafter, sorted({1} | {len(ids) for _, ids, _ in batches}), args.cost_cache_dir
    )
    for policy in methods.values():  # warm-up: first-call allocations and kernel selection
        timed_generate(target, drafter, policy, batches[0][2], {**settings, "max_new_tokens": WARMUP_TOKENS})

    samples = []
    for index, (set_name, ids, inputs) in enumerate(batches):
        outputs = {}
        for method in rotated(names, index):
            output, seconds = timed_generate(target, drafter, methods[method], inputs, settings)
            outputs[method] = output
            generated = output[:, inputs["input_ids"].shape[1] :]
            stats = drafter.last_acceptance if methods[method] is not None else None
            samples.append(
                {
                    "set": set_name,
                    "prompt_ids": ids,
                    "method": method,
                    "new_tokens": int((generated != pad_token_id).sum()),
                    "seconds": seconds,
                    "acceptance_lengths": list(stats.acceptance_lengths) if stats else None,
                    "block_sizes": list(stats.block_sizes) if stats else None,
                }
            )
        for sample in samples[-len(names) :]:
            method = sample["method"]
            sample["identical"] = None if method == "plain" else torch.equal(outputs[method], outputs["plain"])
        print(f"[{index + 1}/{len(batches)}] {set_name} {', '.join(ids)}")

    summary = summarize(samples, names)
    print(f"\n{models.drafter_description}; {machine_description(target.device)}; batch size {args.batch_size}")
    print_table(summary)
    prompt_ids = sorted({i for s in samples for i in s["prompt_ids"]}) if args.demo_prompts else []
    per_prompt = {i: summarize([s for s in samples if i in s["prompt_ids"]], names) for i in prompt_ids}
    for prompt_id, prompt_summary in per_prompt.items():
        print(f"\n{prompt_id}:")
        print_table(prompt_summary)
    report = {
        "settings": {k: v for k, v in vars(args).items()},
        "machine": machine_description(target.device),
        "drafter": models.drafter_description,
        "block_size": drafter.config.block_size,
        "cost_model": cost_model.to_dict(),
        "summary": summary,
        "sets": {name: summarize([s for s in samples if s["set"] == name], names) for name in prompt_sets},
        "prompts": per_prompt,
        "samples": samples,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return report


if __name__ == "__main__":
    main()
