"""How well the cost model prices the rounds the loop runs: each round's wall time beside the seconds its policy
priced it at, by round type, on the README's sets.

Two policies choose every round by expected tokens per second from the cost model measured once per model pair
and machine (`hf_dflash/generation/policies/cost_timing.py`: each pass timed alone, eager, at a 256-token context): the
confident prefix of a chain (`block_size_policy="confidence"`) and the hybrid budget (`prompt_lookup_num_tokens`).
What the model leaves out (the loop's glue, the real context, compiled kernels priced from eager timings) would
bias their choices. Each round is timed from one choice to the next:

    python benchmarks/generation/round_pricing.py --dtype float32 --method dflash-compiled --out out/pricing.json
    python benchmarks/generation/round_pricing.py --dtype float32 --method hybrid \\
        --cost-model ~/.cache/hf_dflash/cost_models/A.json --cost-model ~/.cache/hf_dflash/cost_models/B.json

Round types. A chain under "confidence": `plain` (drafting did not pay: a plain step without a drafter pass),
`none` (drafted, no draft verified), `drafts` (drafted, m >= 1 verified), priced verify(1), drafter + verify(1),
drafter + verify(m + 1). Hybrid: `plain` (k = 1, no n-gram drafts), `ngram` (k = 1, m >= 1), `block` (k >= 2, no
n-gram drafts), `both`, priced by the budget's table (`CostModel.tree_round_seconds`). `--cost-model FILE`
(repeatable) serves the calls from that cost-model file (e.g. another day's timing of this machine) instead of
this machine's cache: the choices then differ, and each file's tokens per second are printed side by side.
Compiled methods run each prompt once untimed first (a new static cache length compiles a graph).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from hf_dflash.bench.methods import COMPILED_METHODS, generate_with
from hf_dflash.bench.prompts import load_prompt_sets
from hf_dflash.bench.runner import chat_inputs
from hf_dflash.checkpoints import load_drafter
from hf_dflash.generation.policies.confidence import ConfidentPrefix, PrefixController
from hf_dflash.generation.policies.cost_model import CostModel
from hf_dflash.generation.policies.hybrid_budget import TreeBudget
from hf_dflash.json_files import write_json_atomic
from hf_dflash.targets import load_target

METHODS = ("dflash", "dflash-compiled", "hybrid", "hybrid-compiled")


def chain_round_type(k: int, m: int | None) -> str:
    return "plain" if k == 1 else ("none" if not m else "drafts")


HYBRID_ROUND_TYPES = {(False, False): "plain", (False, True): "ngram", (True, False): "block", (True, True): "both"}


def hybrid_round_type(k: int, m: int) -> str:
    return HYBRID_ROUND_TYPES[(k > 1, m > 0)]


@contextmanager
def priced_rounds(rounds: list[dict]) -> Iterator[None]:
    """Append {"type", "timed", "priced"} (seconds) to `rounds` for every round a confident-prefix controller or a
    hybrid budget chooses and a next choice ends (the last round of a call and a hybrid prefill are left out)."""
    pending: dict[int, dict] = {}  # id(controller) -> the open round

    def close(owner, now: float) -> None:
        round_ = pending.pop(id(owner), None)
        if round_ is not None and round_["priced"] is not None:
            rounds.append({"type": round_["type"], "timed": now - round_.pop("start"), "priced": round_["priced"]})

    def chain_choose(self, rows):
        now = time.perf_counter()
        close(self, now)
        k = original["chain_choose"](self, rows)
        verify = self.seconds.get(len(rows), (None, None))[0]
        priced = None if k > 1 or verify is None else float(verify[0])  # a drafted round is priced by `prefix`
        pending[id(self)] = {"type": chain_round_type(k, None), "start": now, "priced": priced}
        return k

    def chain_prefix(self, draft_probabilities):
        m = original["chain_prefix"](self, draft_probabilities)
        verify, drafting = self.seconds[draft_probabilities.shape[0]]
        pending[id(self)].update(type=chain_round_type(2, m), priced=drafting + float(verify[m]))
        return m

    def budget_choose(self, ngram_found, block_allowed=True, match_length=1):
        now = time.perf_counter()
        close(self, now)
        k, m = original["budget_choose"](self, ngram_found, block_allowed, match_length)
        priced = float(self.seconds[k - 1, m]) if block_allowed and self.seconds is not None else None
        pending[id(self)] = {"type": hybrid_round_type(k, m), "start": now, "priced": priced}
        return k, m

    original = {
        "chain_choose": PrefixController.choose,
        "chain_prefix": PrefixController.prefix,
        "budget_choose": TreeBudget.choose,
    }
    PrefixController.choose, PrefixController.prefix, TreeBudget.choose = chain_choose, chain_prefix, budget_choose
    try:
        yield
    finally:
        PrefixController.choose = original["chain_choose"]
        PrefixController.prefix = original["chain_prefix"]
        TreeBudget.choose = original["budget_choose"]


def summary(rounds: list[dict]) -> dict:
    """Per round type: rounds, median timed and priced ms, median timed / priced."""
    by_type = defaultdict(list)
    for round_ in rounds:
        by_type[round_["type"]].append(round_)
    return {
        kind: {
            "rounds": len(group),
            "timed_ms": 1000 * statistics.median(r["timed"] for r in group),
            "priced_ms": 1000 * statistics.median(r["priced"] for r in group),
            "timed_over_priced": statistics.median(r["timed"] / r["priced"] for r in group),
        }
        for kind, group in sorted(by_type.items())
    }


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target, dtype=args.dtype)
    drafter = load_drafter(args.drafter, dtype=target.dtype).eval()
    records = load_prompt_sets(args.sets.split(","), num_prompts=args.num_prompts).values()
    prompts = [record for records_of_set in records for record in records_of_set]
    cost_models = {path: CostModel.from_dict(json.loads(Path(path).read_text())) for path in args.cost_model}
    arms = list(cost_models) or ["this machine's cache"]
    generation_kwargs = {"do_sample": False, "max_new_tokens": args.max_new_tokens}
    policy_setting = getattr(drafter, "block_size_policy", None)
    results = {}
    try:
        first = True
        for arm in arms:
            # a given cost model is used as given (no calibration); hybrid budgets run the adaptive block size on it
            drafter.block_size_policy = ConfidentPrefix(cost_model=cost_models.get(arm))
            rounds, tokens, seconds, lengths = [], 0, 0.0, []
            for record in prompts:
                inputs = chat_inputs(tokenizer, record["messages"][:1], target.device)
                if first or args.method in COMPILED_METHODS:
                    generate_with(args.method, target, drafter, inputs, generation_kwargs)  # untimed warm-up
                    first = False
                with priced_rounds(rounds):
                    generation = generate_with(args.method, target, drafter, inputs, generation_kwargs)
                new = generation.sequences.shape[1] - inputs["input_ids"].shape[1]
                tokens, seconds = tokens + new, seconds + generation.seconds
                lengths += generation.acceptance_lengths
                print(f"{arm} {record['id']}: {new} tokens, {new / generation.seconds:.1f} tok/s", flush=True)
            results[arm] = {
                "tokens": tokens,
                "seconds": seconds,
                "tok_s": tokens / seconds,
                "rounds": len(lengths),
                "tau": sum(lengths) / len(lengths),
                "by_type": summary(rounds),
                "round_records": rounds,
            }
    finally:
        drafter.block_size_policy = policy_setting
    return {"settings": vars(args), "prompts": [record["id"] for record in prompts], "arms": results}


def print_table(result: dict) -> None:
    print("| cost model | tok/s | τ | round type | rounds | timed ms | priced ms | timed / priced |")
    print("|---|---|---|---|---|---|---|---|")
    for arm, row in result["arms"].items():
        for kind, cell in row["by_type"].items():
            print(
                f"| {arm} | {row['tok_s']:.1f} | {row['tau']:.2f} | {kind} | {cell['rounds']} | "
                f"{cell['timed_ms']:.1f} | {cell['priced_ms']:.1f} | {cell['timed_over_priced']:.2f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default="models/smollm2-135m-instruct-dflash")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--method", default="dflash", choices=METHODS)
    parser.add_argument("--cost-model", action="append", default=[], help="a cost-model cache file (repeatable)")
    parser.add_argument("--sets", default="gsm8k,humaneval,mt-bench,alpaca-eval")
    parser.add_argument("--num-prompts", type=int, default=2, help="prompts per set (seed 0, as the bench samples)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default="out/round_pricing.json")
    args = parser.parse_args()
    result = run(args)
    print_table(result)
    write_json_atomic(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
