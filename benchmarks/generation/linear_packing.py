"""Our loop with and without oneDNN-packed linear layers, beside plain decoding with and without them.

The lever of `hf_dflash.packed_linears` (`drafter.linear_packing`), measured side by side: per prompt, in turn,

    plain            target.generate(...)                              the default aten matmul
    plain-packed     the same inside packed_linears(target)
    dflash-off       target.generate(..., assistant_model=drafter) with drafter.linear_packing = False
    dflash           the same with linear_packing "auto" (the default)
    hybrid-off / hybrid   + prompt_lookup_num_tokens=10

greedy, one chat turn per prompt; every answer is compared with plain's. Ratios are against the fastest plain
decoding of the run. Prints a table and writes JSON:

    python benchmarks/generation/linear_packing.py --dtype float32 --out out/packing.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from hf_dflash.bench.loading import machine_description
from hf_dflash.bench.prompts import load_prompt_sets
from hf_dflash.bench.runner import chat_inputs
from hf_dflash.checkpoints import load_drafter
from hf_dflash.json_files import write_json_atomic
from hf_dflash.packed_linears import packed_linears, packing_pays
from hf_dflash.targets import load_target

METHODS = ("plain", "plain-packed", "dflash-off", "dflash", "hybrid-off", "hybrid")


def run(method: str, target, drafter, inputs: dict, max_new_tokens: int):
    """(sequences, seconds, acceptance lengths or None) of one greedy call of `method`."""
    kwargs = dict(do_sample=False, max_new_tokens=max_new_tokens)
    if method.startswith(("dflash", "hybrid")):
        drafter.linear_packing = False if method.endswith("-off") else "auto"
        kwargs["assistant_model"] = drafter
    if method.startswith("hybrid"):
        kwargs["prompt_lookup_num_tokens"] = 10
    with packed_linears(target) if method == "plain-packed" else torch.no_grad():
        start = time.perf_counter()
        sequences = target.generate(**inputs, **kwargs)
        seconds = time.perf_counter() - start
    lengths = None if "assistant_model" not in kwargs else list(drafter.last_acceptance.acceptance_lengths)
    return sequences, seconds, lengths


def main(args: argparse.Namespace) -> None:
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"linear_packing.py: error: {out} exists; choose another --out or remove it")
    dtype = getattr(torch, args.dtype)
    target, tokenizer = load_target(dtype=dtype)
    drafter = load_drafter(args.drafter, dtype=dtype).eval()
    prompts = [
        p for records in load_prompt_sets(args.sets.split(","), num_prompts=args.num_prompts).values() for p in records
    ]
    totals = {method: {"tokens": 0, "seconds": 0.0, "rounds": 0, "committed": 0, "diverged": 0} for method in METHODS}
    warm = chat_inputs(tokenizer, prompts[0]["messages"][:1], target.device)
    for method in METHODS:  # first calls: packs, cost models, allocations
        run(method, target, drafter, warm, 8)
    for index, record in enumerate(prompts):
        inputs = chat_inputs(tokenizer, record["messages"][:1], target.device)
        prompt_length = inputs["input_ids"].shape[1]
        reference = None
        for method in METHODS[index % len(METHODS) :] + METHODS[: index % len(METHODS)]:
            sequences, seconds, lengths = run(method, target, drafter, inputs, args.max_new_tokens)
            row = totals[method]
            row["tokens"] += sequences.shape[1] - prompt_length
            row["seconds"] += seconds
            if lengths:
                row["rounds"] += len(lengths)
                row["committed"] += sum(lengths)
            if method == "plain":
                reference = sequences
            row.setdefault("answers", []).append(sequences[0, prompt_length:].tolist())
        for method in METHODS:
            if totals[method]["answers"][-1] != reference[0, prompt_length:].tolist():
                totals[method]["diverged"] += 1
        print(f"prompt {index + 1}/{len(prompts)} done", flush=True)
    fastest = max(totals[m]["tokens"] / totals[m]["seconds"] for m in ("plain", "plain-packed"))
    print(
        f"\n{machine_description(target.device)}, {args.dtype}, {len(prompts)} prompts x {args.max_new_tokens} tokens"
    )
    print("| method | τ | tok/s | × the fastest plain | answers unlike plain |\n|---|---|---|---|---|")
    for method, row in totals.items():
        speed = row["tokens"] / row["seconds"]
        tau = f"{row['committed'] / row['rounds']:.2f}" if row["rounds"] else "–"
        row |= {"tok_s": speed, "speedup": speed / fastest}
        print(f"| {method} | {tau} | {speed:.1f} | {speed / fastest:.2f}× | {row['diverged']} |")
    result = {
        "command": "python benchmarks/generation/linear_packing.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "machine": machine_description(target.device),
        "threads": torch.get_num_threads(),
        "packing_pays": {"target": packing_pays(target), "drafter": packing_pays(drafter)},
        "methods": totals,
    }
    write_json_atomic(out, result)
    print(f"wrote {out}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default="models/smollm2-135m-instruct-dflash")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--sets", default="gsm8k,humaneval,mt-bench,alpaca-eval")
    parser.add_argument("--num-prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default="out/linear_packing.json")
    return parser.parse_args()


if __name__ == "__main__":
    main(parse_args())
