"""Learning curve on CPU: held-out served-walk τ against chats seen, on all the data and on a subset.

Does data or training limit the drafter? One recipe, trained for the same number of steps with the
same schedule, on all the committed chats and on the first `--subset` chats only (several epochs of
them). Each run logs `eval_served_tau` on the same fixed held-out chats (the first `--samples` chats of
`--eval-part`) every `--eval-every` steps: on all the data every point is the τ after that many
*distinct* chats; where the subset's curve falls below it at equal steps, the subset ran out of data.
After training, the final drafters (and the shipped one) are scored again by
`benchmarks/training/heldout_tau.py`, which must agree with the last logged point. Prints a table, writes JSON.
Re-running resumes: a run whose drafter is saved is not trained again.

    python benchmarks/training/learning_curve.py --out-dir out/curve600 --steps 600 --eval-every 150 --subset 600 \\
        --json docs/results/training/learning_curve_cpu.json

The runs go through `benchmarks/training/recipe_comparison.py`'s training (`scripts/train_on_gpu.py --device
cpu`, one thread per run, `--parallel` at a time); the intermediate points are not annealed (the
cosine schedule ends at `--steps`), the same for every run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# The CPU runs and their scoring are recipe_comparison's (beside this file: found without a sys.path edit).
from recipe_comparison import add_run_arguments, score_heldout, train_missing, write_result

from hf_dflash.trainer.variants import bf16_drafter_folder, variant_name, with_base

# The recipe comparison's winner per CPU-hour: 2 layers, block 8 (γ 4), the 8,192-id draft vocabulary.
BASE = "num_hidden_layers=2,draft_vocab_size=8192,block_size=8,training.block_size=8,training.dataloader_num_workers=0"


def run_specs(steps: int, eval_every: int, subsets: list[int], samples: int) -> list[str]:
    """The runs: all the chats, then each subset; same steps and evaluation points for all, each
    evaluation walking all `samples` held-out chats the way serving does (the trainer's default is 16)."""
    schedule = f"training.max_steps={steps},training.eval_steps={eval_every},training.eval_served_tau={samples}"
    return [f"all-chats:{schedule}", *(f"{n}-chats:{schedule},data.max_train_samples={n}" for n in subsets)]


def curve_points(log: dict, batch_size: int, train_samples: int) -> list[dict]:
    """One row per logged evaluation: step, chats seen, epochs, served-walk and all-anchor τ (both from
    the trainer's walk over the held-out chats, as `benchmarks/training/heldout_tau.py` computes them)."""
    return [
        {
            "step": entry["step"],
            "chats_seen": entry["step"] * batch_size,
            "epochs": round(entry["step"] * batch_size / train_samples, 2),
            "served_tau": round(entry["eval_served_tau"], 4),
            "all_anchor_tau": round(entry["eval_all_anchor_tau"], 4),
        }
        for entry in log["eval_served"]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser, out_dir="out/curve", base=BASE)
    parser.add_argument("--steps", type=int, default=2400, help="optimizer steps per run (the cosine schedule's end)")
    parser.add_argument("--eval-every", type=int, default=300, help="steps between held-out evaluations")
    parser.add_argument("--subset", type=int, action="append", default=None, help="chats of a subset run (repeatable)")
    parser.add_argument("--json", default="out/learning_curve.json")
    # Every run fixes its length (training.max_steps): no wall-clock budget and no timing run apply.
    parser.set_defaults(train_seconds=0.0, calibration_steps=16)
    args = parser.parse_args()
    if args.eval_every < 1 or args.steps < args.eval_every:
        parser.error(f"--eval-every must be in 1..--steps, got {args.eval_every} with --steps {args.steps}")
    args.out_dir = Path(args.out_dir)
    specs = run_specs(args.steps, args.eval_every, args.subset or [2400], args.samples)
    names = [variant_name(spec) for spec in specs]
    train_missing(specs, args)

    folders = [bf16_drafter_folder(args.out_dir, name) for name in names]
    heldout = score_heldout([args.reference, *map(str, folders)], args, args.out_dir / "heldout.json")
    runs = []
    for spec, name, folder in zip(specs, names, folders):
        log = json.loads((folder / "gpu_training_log.json").read_text())
        runs.append(
            {
                "run": name,
                "spec": with_base(spec, args.base),
                "train_samples": log["train_samples"],
                "train_seconds": round(log["train_seconds"]),
                "points": curve_points(log, args.batch_size, log["train_samples"]),
                "final_heldout": heldout[str(folder)],
            }
        )

    print(f"\nheld out: the first {args.samples} chats of {args.eval_part}; {args.steps} steps of "
          f"{args.batch_size} chats x {args.num_anchors} anchors, one thread per run\n")  # fmt: skip
    headers = [f"{run['run']} ({run['train_samples']} chats): served τ (epochs)" for run in runs]
    print("| step | chats seen | " + " | ".join(headers) + " |")
    print("|---|---|" + "---|" * len(runs))
    for index, point in enumerate(runs[0]["points"]):
        cells = [f"{run['points'][index]['served_tau']:.3f} ({run['points'][index]['epochs']})" for run in runs]
        print(f"| {point['step']} | {point['chats_seen']} | " + " | ".join(cells) + " |")
    finals = " | ".join(f"{run['final_heldout']['served_tau']:.3f}" for run in runs)
    print(f"| final, heldout_tau.py | | {finals} |")
    print(f"\nreference {args.reference}: served-walk τ {heldout[args.reference]['served_tau']:.3f}")
    write_result(args, {"runs": specs}, reference=heldout[args.reference], runs=runs)


if __name__ == "__main__":
    main()
