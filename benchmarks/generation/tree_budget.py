"""Which draft-tree budget pays on this machine? The chain, fixed tree sizes and "auto" side by side.

On the same chat prompts (`--sets`, `--num-prompts` each), greedy, `--max-new-tokens`, the target in the
dtype `auto` picks, methods interleaved per prompt (order rotated):

- `plain`: `generate` without a drafter (the baseline);
- `chain`: our loop, the drafter's block as one chain;
- `tree-N`: a draft tree of (up to) N nodes every round (`drafter.draft_tree = N`);
- `auto-C`: the tree size chosen each round from the cost curve (`TreeDrafting` with the round seconds
  of the cost model), its verification passes timed after a C-token context (`--contexts`; the
  cost model's own timing uses `VERIFICATION_CONTEXT`).

Every answer is compared with `plain` token for token; per method: tok/s, speed-up over plain and over the
chain, τ, mean tree nodes per round, and the verification seconds of each context (the cost curves).

    python benchmarks/generation/tree_budget.py --out out/tree_budget.json
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch

from hf_dflash.bench.prompts import load_prompt_sets
from hf_dflash.bench.runner import chat_inputs, rotated
from hf_dflash.checkpoints import load_drafter
from hf_dflash.dtypes import cpu_flags
from hf_dflash.generation.policies.cost_model import CostModel
from hf_dflash.generation.policies.cost_timing import measure_verification_seconds, measured_cost_model
from hf_dflash.generation.policies.tree_size import AUTO_MAX_NODES, auto_tree_drafting
from hf_dflash.json_files import write_json_atomic
from hf_dflash.targets import load_target


def timed(target, inputs, settings, drafter) -> tuple[torch.LongTensor, float]:
    start = time.perf_counter()
    sequences = target.generate(**inputs, **settings, **({"assistant_model": drafter} if drafter else {}))
    return sequences, time.perf_counter() - start


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default="models/smollm2-135m-instruct-dflash")
    parser.add_argument("--sets", default="gsm8k,humaneval,mt-bench,alpaca-eval")
    parser.add_argument("--num-prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--sizes", default="8,16,32", help="fixed tree sizes (nodes, root included)")
    parser.add_argument("--contexts", default="64,256", help="context lengths of the verification timing")
    parser.add_argument("--out", default="out/tree_budget.json")
    args = parser.parse_args()
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"tree_budget.py: error: {out} exists; choose another --out or remove it")
    sizes = [int(size) for size in args.sizes.split(",")]
    contexts = [int(context) for context in args.contexts.split(",")]
    prompt_sets = load_prompt_sets(args.sets.split(","), num_prompts=args.num_prompts)
    prompts = [record["messages"][:1] for records in prompt_sets.values() for record in records]
    target, tokenizer = load_target()
    drafter = load_drafter(args.drafter, dtype=target.dtype).eval()
    block_size = drafter.config.block_size
    drafter.block_size_policy = block_size

    base = measured_cost_model(target, drafter, (1,), verification=True, max_verified_tokens=AUTO_MAX_NODES)
    lengths = base.verification_lengths
    curves = {
        context: tuple(measure_verification_seconds(target, drafter, 1, lengths, context_length=context))
        for context in contexts
    }
    costs = {
        context: CostModel(base.block_lengths, base.seconds, lengths, {1: curve}) for context, curve in curves.items()
    }
    settings = {"do_sample": False, "max_new_tokens": args.max_new_tokens, "pad_token_id": tokenizer.eos_token_id}

    def tree_setting(method: str):
        if method.startswith("tree-"):
            return int(method.removeprefix("tree-"))
        if method.startswith("auto-"):  # a fresh calibration per call, as "auto" starts each generate
            return auto_tree_drafting(costs[int(method.removeprefix("auto-"))], block_size)
        return None

    methods = ["plain", "chain", *(f"tree-{size}" for size in sizes), *(f"auto-{context}" for context in contexts)]
    warm = chat_inputs(tokenizer, prompts[0], target.device)
    for method in methods:  # first calls: allocations and per-shape kernel selection, untimed
        drafter.draft_tree = tree_setting(method)
        timed(target, warm, {**settings, "max_new_tokens": 16}, None if method == "plain" else drafter)
    tokens = dict.fromkeys(methods, 0)
    seconds = dict.fromkeys(methods, 0.0)
    identical = dict.fromkeys(methods, True)
    rounds: dict[str, list[int]] = {method: [] for method in methods}
    nodes: dict[str, list[int]] = {method: [] for method in methods}
    for index, messages in enumerate(prompts):
        inputs = chat_inputs(tokenizer, messages, target.device)
        runs = {}
        for method in rotated(methods, index):
            drafter.draft_tree = tree_setting(method)
            runs[method] = timed(target, inputs, settings, None if method == "plain" else drafter)
            if method != "plain":
                rounds[method] += drafter.last_acceptance.acceptance_lengths
                nodes[method] += drafter.last_acceptance.tree_sizes or []
        for method, (sequences, spent) in runs.items():
            tokens[method] += sequences.shape[1] - inputs["input_ids"].shape[1]
            seconds[method] += spent
            identical[method] &= torch.equal(sequences, runs["plain"][0])
    drafter.draft_tree = None
    rates = {method: tokens[method] / seconds[method] for method in methods}
    results = {
        "methods": {
            method: {
                "tok_s": round(rates[method], 2),
                "speedup_vs_plain": round(rates[method] / rates["plain"], 3),
                "speedup_vs_chain": round(rates[method] / rates["chain"], 3),
                "tau": round(sum(rounds[method]) / len(rounds[method]), 3) if rounds[method] else None,
                "mean_nodes": round(sum(nodes[method]) / len(nodes[method]), 1) if nodes[method] else None,
                "identical_to_plain": identical[method],
            }
            for method in methods
        },
        "verification_ms": {
            str(context): dict(zip(map(str, lengths), (round(s * 1000, 1) for s in curve), strict=True))
            for context, curve in curves.items()
        },
    }
    flags = cpu_flags() or frozenset()
    results["machine"] = {
        "processor": platform.processor() or platform.machine(),
        "native_bf16": bool({"avx512_bf16", "amx_bf16"} & flags),
        "dtype": str(target.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    results["settings"] = {**vars(args), "prompts": len(prompts)}
    print("| method | tok/s | × plain | × chain | τ | nodes/round | identical |\n|---|---|---|---|---|---|---|")
    for method, row in results["methods"].items():
        tau = "-" if row["tau"] is None else f"{row['tau']:.2f}"
        mean_nodes = "-" if row["mean_nodes"] is None else f"{row['mean_nodes']:.1f}"
        print(
            f"| {method} | {row['tok_s']:.1f} | {row['speedup_vs_plain']:.2f}× | {row['speedup_vs_chain']:.2f}× | "
            f"{tau} | {mean_nodes} | {row['identical_to_plain']} |"
        )
    for context, curve in results["verification_ms"].items():
        print(f"verification ms after {context} tokens: " + ", ".join(f"{n}: {ms}" for n, ms in curve.items()))
    write_json_atomic(out, results)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
