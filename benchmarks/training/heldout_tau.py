"""Held-out τ of several drafters, side by side, on one fixed set of committed chats.

The figure that decides whether a new drafter replaces the shipped one, before the (slow) bench: for
each drafter, the served-walk τ (`served_tau_estimate`: anchors visited the way `generate` visits
them, predicted round for round by the training forward) and the uniform all-anchor τ, on the same
held-out chats of a packed folder (`--eval-part`: the first `--samples` chats of that part, a set that
does not move when more data is packed; without it, the last `--samples` chats, of `--parts` when given: a set
that was the data's last before more parts were appended).

    python benchmarks/training/heldout_tau.py models/smollm2-135m-instruct-dflash out/run/drafters/L3-bf16 \\
        --data data/smollm2-135m-instruct --eval-part regen-bf16-part2 --samples 64

With `--reply-tokens 128` each reply is scored over its first 128 tokens only, as `generate(max_new_tokens=128)`
serves it: the figure to set beside a 128-token bench (τ is lowest at the start of a reply).

With `--temperatures 0.7,1.0` it also scores sampling (`hf_dflash.trainer.sampling_tau`): the expected all-anchor
τ when `generate(do_sample=True, temperature=T)` serves the chain with drafts sampled from the drafter ("sample"), its
argmax ("argmax") or its top-N tokens per slot ("top-N"), each verified losslessly.

Per data source (the sample id's prefix: gsm8k, sharegpt, ...) it prints the served-walk τ too, the table
that shows the weakest domain. With `--tree-budgets 8,16,32,64` it also scores draft trees (`served_tree_tau_estimates`): the τ greedy
verification of the drafter's best-first tree of N nodes would serve, beside the chain's, before any
timing decides whether a bigger tree pays.
"""

import argparse
import json
import time
from pathlib import Path

import torch

from hf_dflash.checkpoints import load_drafter
from hf_dflash.targets import load_target
from hf_dflash.trainer.consistency import served_tree_tau_estimates
from hf_dflash.trainer.heldout import held_out_samples, heldout_tau_row
from hf_dflash.trainer.sampling_tau import draft_temperature_taus, sampling_tau_estimate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafters", nargs="+", help="drafter folders (either checkpoint format)")
    parser.add_argument("--data", default="data/smollm2-135m-instruct", help="packed folder (default: %(default)s)")
    parser.add_argument("--eval-part", default=None, help="hold out the first --samples chats of this part")
    parser.add_argument(
        "--parts", default=None,
        help="comma-separated parts to read (default: all): without --eval-part, the last --samples of these",
    )  # fmt: skip
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument(
        "--reply-tokens",
        type=int,
        default=None,
        help="score each reply's first N tokens only, as generate(max_new_tokens=N) serves them (default: whole)",
    )
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto", help="target and drafter dtype (default: auto)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--tree-budgets", default="", help="comma-separated tree sizes N (nodes, root included)")
    parser.add_argument("--top-k", type=int, default=16, help="candidates per draft slot in a tree")
    parser.add_argument("--temperatures", default="", help="comma-separated sampling temperatures > 0 to score")
    parser.add_argument(
        "--draft-temperatures",
        default="",
        help="comma-separated draft temperatures T' > 0: also score drafts sampled from q at T' (drafter.draft_temperature)",
    )
    parser.add_argument("--out", default="out/heldout_tau.json")
    args = parser.parse_args()
    budgets = [int(n) for n in args.tree_budgets.split(",") if n]
    if any(n < 1 for n in budgets) or args.top_k < 1:
        parser.error(
            f"--tree-budgets must be positive node counts and --top-k >= 1, got {args.tree_budgets!r}, {args.top_k}."
        )
    if args.reply_tokens is not None and args.reply_tokens < 2:
        parser.error(f"--reply-tokens must be >= 2 (tokens served per reply), got {args.reply_tokens}.")
    if budgets and args.reply_tokens is not None:
        parser.error("--reply-tokens scores the chain only; drop --tree-budgets or --reply-tokens.")
    temperatures = [float(t) for t in args.temperatures.split(",") if t]
    draft_temperatures = [float(t) for t in args.draft_temperatures.split(",") if t]
    if any(t <= 0 for t in temperatures):
        parser.error(f"--temperatures must be > 0 (greedy is the default figure), got {args.temperatures!r}.")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    parts = args.parts.split(",") if args.parts else None
    held_out = held_out_samples(args.data, args.samples, args.eval_part, parts)
    target, _ = load_target(args.target, dtype=args.dtype)
    rows = []
    for path in args.drafters:
        drafter = load_drafter(path).to(target.dtype).eval()
        row = heldout_tau_row(drafter, target, held_out, max_reply_tokens=args.reply_tokens)
        rows.append(
            {
                "drafter": path,
                **{key: row[key] for key in ("served_tau", "all_anchor_tau", "rounds", "seconds", "by_source")},
            }
        )
        print(f"{path}: served-walk τ {row['served_tau']:.3f}, all-anchor τ {row['all_anchor_tau']:.3f}", flush=True)
        if budgets:
            start = time.perf_counter()
            trees = served_tree_tau_estimates(drafter, target, held_out, budgets, top_k=args.top_k)
            rows[-1]["trees"] = {
                str(n): {"served_tau": round(t.served_tau, 4), "all_anchor_tau": round(t.uniform_tau, 4)}
                for n, t in trees.items()
            }
            rows[-1]["trees_seconds"] = round(time.perf_counter() - start, 1)
            for n, t in trees.items():
                print(
                    f"  tree of {n} nodes (top-{args.top_k}): served-walk τ {t.served_tau:.3f}, all-anchor τ {t.uniform_tau:.3f}",
                    flush=True,
                )
        if temperatures:
            start = time.perf_counter()
            sampled = sampling_tau_estimate(drafter, target, held_out, temperatures)
            rows[-1]["sampling"] = {str(t): by_rule for t, by_rule in sampled.items()}
            rows[-1]["sampling_seconds"] = round(time.perf_counter() - start, 1)
            for t, by_rule in sampled.items():
                shown = ", ".join(f"{rule} {tau:.3f}" for rule, tau in by_rule.items())
                print(f"  temperature {t}: expected all-anchor τ {shown}", flush=True)
            if draft_temperatures:
                taus = draft_temperature_taus(drafter, target, held_out, temperatures, draft_temperatures)
                rows[-1]["draft_temperatures"] = {
                    str(d): {str(t): tau for t, tau in by.items()} for d, by in taus.items()
                }
                for draft_t, by_t in taus.items():
                    shown = ", ".join(f"T {t}: {tau:.3f}" for t, tau in by_t.items())
                    print(f"  drafts sampled at T' = {draft_t}: expected all-anchor τ {shown}", flush=True)
    held = (
        f"the first {len(held_out)} chats of part {args.eval_part}"
        if args.eval_part
        else f"the last {len(held_out)} chats" + (f" of part(s) {args.parts}" if parts else "")
    )
    print(f"\nheld out: {held} of {args.data}, {target.dtype}\n")
    print("| drafter | served-walk τ | all-anchor τ | rounds |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['drafter']} | {row['served_tau']:.3f} | {row['all_anchor_tau']:.3f} | {row['rounds']} |")
        for n, tree in row.get("trees", {}).items():
            print(f"| {row['drafter']}, tree of {n} | {tree['served_tau']:.3f} | {tree['all_anchor_tau']:.3f} | |")
    sources = sorted({source for row in rows for source in row["by_source"]})
    print("\nserved-walk τ per data source (samples):\n")
    print("| drafter | " + " | ".join(sources) + " |\n|---|" + "---|" * len(sources))
    for row in rows:
        cells = [row["by_source"].get(source) for source in sources]
        shown = [f"{cell['served_tau']:.3f} ({cell['samples']})" if cell else "–" for cell in cells]
        print(f"| {row['drafter']} | " + " | ".join(shown) + " |")
    result = {
        "settings": {**vars(args), "dtype": str(target.dtype), "sample_ids": [sample["id"] for sample in held_out]},
        "results": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
