"""Two or more drafters on identical texts: fp32 greedy, per-slot acceptance of the chain and of hybrid drafting.

A bf16 bench compares drafters on different texts (each method's answer drifts from plain greedy after a near-tie),
and its speed-ups mix the drafter with the host's noise. Here every drafter serves the same prompts in fp32, where
every answer equals plain greedy (checked), so the drafters meet the same tokens and only their acceptance differs:

    python benchmarks/generation/drafter_ab.py models/smollm2-135m-instruct-dflash checkpoints/smollm2-v6-dflash2-candidate \\
        --sets gsm8k,humaneval,mt-bench,alpaca-eval --num-prompts 4 --out out/drafter_ab.json

Per drafter and mode (`chain`: `assistant_model=drafter`; `hybrid`: with the bench's `prompt_lookup_num_tokens`, 10) it prints τ,
P(a round accepts at least t drafts) for t = 1..7, and for hybrid the mean block length and the drafts each branch
got accepted. A DFlash2 drafter is also run with its selector off (`NAME:unary`: each slot's top-1, as a DFlash
drafter drafts), which isolates what the selector adds. First user turn of each prompt only; one thread.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

from hf_dflash.bench.methods import PROMPT_LOOKUP_NUM_TOKENS
from hf_dflash.bench.prompts import load_prompt_sets
from hf_dflash.bench.runner import chat_inputs
from hf_dflash.checkpoints import load_drafter
from hf_dflash.generation.policies.block_size import parse_block_size_policy
from hf_dflash.json_files import write_json_atomic
from hf_dflash.targets import load_target

MODES = {"chain": {}, "hybrid": {"prompt_lookup_num_tokens": PROMPT_LOOKUP_NUM_TOKENS}}  # as the bench runs them
DEPTHS = range(1, 8)


@contextmanager
def selector_off(drafter) -> Iterator[None]:
    """The drafter drafts each slot's top-1 (its selector set aside) inside the block."""
    selector = drafter.candidate_selector
    drafter.candidate_selector = None
    try:
        yield
    finally:
        drafter.candidate_selector = selector


def arms(paths: list[str], block_size_policy: str = "recommended") -> list[tuple[str, torch.nn.Module, bool]]:
    """(label, drafter, selector off) per arm: every drafter, and a DFlash2 one again without its selector; each
    drafter's block length per round from `block_size_policy` (as `hf-dflash bench --block-size-policy`)."""
    result = []
    for path in paths:
        drafter = load_drafter(path, dtype=torch.float32).eval()
        drafter.block_size_policy = parse_block_size_policy(block_size_policy, drafter.config.block_size)
        result.append((path, drafter, False))
        if drafter.candidate_selector is not None:
            result.append((f"{path}:unary", drafter, True))
    return result


def summary(lengths: list[int], blocks: list[int], branch_tokens: list[int] | None) -> dict:
    """τ, P(accepted drafts >= t) for t in DEPTHS, mean block, and (hybrid) the accepted drafts by branch."""
    rounds = len(lengths)
    row = {
        "rounds": rounds,
        "tau": sum(lengths) / rounds,
        "accepted_at_least": {t: sum(length > t for length in lengths) / rounds for t in DEPTHS},
        "mean_block": sum(blocks) / len(blocks),
    }
    if branch_tokens is not None:
        row["block_drafts_accepted"], row["ngram_drafts_accepted"] = branch_tokens
    return row


def run(args: argparse.Namespace) -> dict:
    """Every arm and mode on every prompt, each answer checked against plain greedy; the rows of `summary`."""
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target, dtype="float32")
    records = load_prompt_sets(args.sets.split(","), num_prompts=args.num_prompts).values()
    prompts = [record for records_of_set in records for record in records_of_set]
    drafter_arms = arms(args.drafters, args.block_size_policy)
    collected = {}  # "label mode" -> (round lengths, block lengths, [block, n-gram] accepted drafts)
    for record in prompts:
        inputs = chat_inputs(tokenizer, record["messages"][:1], target.device)
        plain = target.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
        for label, drafter, unary in drafter_arms:
            for mode, extra in MODES.items():
                with selector_off(drafter) if unary else nullcontext():
                    out = target.generate(
                        **inputs, assistant_model=drafter, max_new_tokens=args.max_new_tokens, do_sample=False, **extra
                    )
                if not torch.equal(out, plain):
                    raise RuntimeError(f"{label} {mode} differs from plain greedy on {record['id']}: a lossless bug")
                stats = drafter.last_acceptance
                lengths, blocks, branches = collected.setdefault(f"{label} {mode}", ([], [], [0, 0]))
                lengths += stats.acceptance_lengths
                blocks += stats.block_sizes
                branches[0] += sum(stats.block_tokens)
                branches[1] += sum(stats.ngram_tokens)
        taus = ", ".join(f"{arm} {sum(v[0]) / len(v[0]):.3f}" for arm, v in collected.items())
        print(f"{record['id']} (running τ): {taus}", flush=True)
    rows = {
        arm: summary(lengths, blocks, branches if arm.endswith(" hybrid") else None)
        for arm, (lengths, blocks, branches) in collected.items()
    }
    return {"settings": vars(args), "prompts": [record["id"] for record in prompts], "rows": rows}


def print_table(result: dict) -> None:
    header = (
        "| arm | rounds | τ | " + " | ".join(f"P(≥{t})" for t in DEPTHS) + " | mean block | block / n-gram drafts |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for arm, row in result["rows"].items():
        shares = " | ".join(f"{row['accepted_at_least'][t]:.3f}" for t in DEPTHS)
        branches = (
            f"{row['block_drafts_accepted']} / {row['ngram_drafts_accepted']}"
            if "ngram_drafts_accepted" in row
            else "–"
        )
        print(f"| {arm} | {row['rounds']} | {row['tau']:.3f} | {shares} | {row['mean_block']:.2f} | {branches} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafters", nargs="+", help="drafter folders (either checkpoint format)")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--sets", default="gsm8k,humaneval,mt-bench,alpaca-eval")
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts per set (seed 0, as the bench samples)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--block-size-policy",
        default="recommended",
        help="'recommended' (each drafter config's), 'trained' (the whole block every round: acceptance alone, "
        "no timing in the choice), 'adaptive', 'confidence' or k",
    )
    parser.add_argument("--out", default="out/drafter_ab.json")
    args = parser.parse_args()
    result = run(args)
    print_table(result)
    write_json_atomic(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
