"""Drafter recipes compared at one fixed training budget: held-out τ per CPU-hour.

Each variant trains from the committed data for the same wall-clock budget on one thread
(`scripts/train_on_gpu.py --device cpu`, `--parallel` variants at a time, one core each: a variant
whose steps are cheaper gets more of them), then every drafter is scored by `benchmarks/training/heldout_tau.py`
on the same fixed held-out chats (the first `--samples` chats of `--eval-part`), beside the shipped
drafter. Prints a table and writes JSON. Re-running resumes: a variant whose drafter is already saved
is not trained again.

    python benchmarks/training/recipe_comparison.py --out-dir out/recipe --train-seconds 720 \\
        --json docs/results/training/recipe_comparison_cpu.json

A variant is `NAME:key=value,...` as in `scripts/train_on_gpu.py` (bare keys are DFlashConfig fields,
`training.` / `data.` keys reach those sections); `--base` is prepended to every variant.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from hf_dflash.trainer.variants import bf16_drafter_folder, starting_drafter, variant_name, with_base

ROOT = Path(__file__).resolve().parents[2]

BASE = 'num_hidden_layers=2,draft_vocab_size=8192,training.dataloader_num_workers=0,training.eval_strategy="no"'
# Depth, draft vocabulary, block size, initialisation, distillation, one learning-curve point (250
# chats: several epochs in the budget instead of a fraction of one), and v1 continued on the new data.
VARIANTS = (
    "L1:num_hidden_layers=1",
    "L2:",
    "L3:num_hidden_layers=3",
    "L5:num_hidden_layers=5",
    "L2-fullvocab:draft_vocab_size=null",
    "L2-B8:block_size=8,training.block_size=8",
    "L2-init:init_from_target=true",
    "L2-kl:training.loss_type=kl",
    "L2-250chats:data.max_train_samples=250",
    "v1-continued:init_from=models/smollm2-135m-instruct-dflash,training.learning_rate=2e-4",
)


def train_group(specs: list[str], args: argparse.Namespace) -> None:
    """Train `specs` at once, one thread each, for --train-seconds (train_on_gpu's CPU path)."""
    command = [
        sys.executable, str(ROOT / "scripts" / "train_on_gpu.py"), "--device", "cpu", "--data", args.data,
        "--eval-part", args.eval_part, "--eval-samples", str(args.samples), "--out", str(args.out_dir),
        "--train-seconds", str(args.train_seconds), "--train-batch-size", str(args.batch_size),
        "--num-anchors", str(args.num_anchors), "--calibration-steps", str(args.calibration_steps),
        "--seed", str(args.seed),
    ]  # fmt: skip
    for spec in specs:
        command += ["--variant", with_base(spec, args.base)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    print(f"[{time.strftime('%H:%M:%S')}] training {', '.join(map(variant_name, specs))}", flush=True)
    subprocess.run(command, env=env, check=True)


def train_missing(specs: list[str], args: argparse.Namespace) -> None:
    """Train the specs whose drafter is not saved yet, --parallel at a time (re-running resumes)."""
    todo = [spec for spec in specs if not bf16_drafter_folder(args.out_dir, variant_name(spec)).is_dir()]
    for start in range(0, len(todo), args.parallel):
        train_group(todo[start : start + args.parallel], args)


def score_heldout(drafters: list[str], args: argparse.Namespace, out_json: Path) -> dict[str, dict]:
    """`benchmarks/training/heldout_tau.py` on `drafters` (all cores): its row per drafter folder, by folder."""
    subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("heldout_tau.py")),
            *drafters,
            "--data",
            args.data,
            "--eval-part",
            args.eval_part,
            "--samples",
            str(args.samples),
            "--threads",
            str(os.cpu_count() or 1),
            "--out",
            str(out_json),
        ],  # fmt: skip
        check=True,
    )
    return {row["drafter"]: row for row in json.loads(out_json.read_text())["results"]}


def write_result(args: argparse.Namespace, settings: dict, **results) -> None:
    """--json: the settings (the arguments and `settings`), the machine, `results`, the command line."""
    result = {
        "settings": {**vars(args), "out_dir": str(args.out_dir), **settings},
        "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
        **results,
        "command": " ".join(sys.argv),
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


def add_run_arguments(parser: argparse.ArgumentParser, out_dir: str, base: str) -> None:
    """The options of CPU training runs scored on held-out chats (this script's and learning_curve's)."""
    parser.add_argument("--out-dir", default=out_dir, help="runs and drafters (resumed)")
    parser.add_argument("--data", default="data/smollm2-135m-instruct")
    parser.add_argument("--eval-part", default="regen-bf16-part2")
    parser.add_argument("--samples", type=int, default=64, help="held-out chats (excluded from training)")
    parser.add_argument("--parallel", type=int, default=2, help="runs trained at once (one core each)")
    parser.add_argument("--batch-size", type=int, default=4, help="chats per step")
    parser.add_argument("--num-anchors", type=int, default=64, help="blocks per chat per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--base", default=base, help="overrides every run starts from (default: %(default)s)")
    parser.add_argument("--reference", default="models/smollm2-135m-instruct-dflash", help="scored beside the runs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser, out_dir="out/recipe", base=BASE)
    parser.add_argument("--train-seconds", type=float, default=720, help="wall-clock budget per variant")
    parser.add_argument("--calibration-steps", type=int, default=16)
    parser.add_argument(
        "--variant", action="append", default=None, help="NAME:key=value,... (default: the built-in list)"
    )
    parser.add_argument("--json", default="out/recipe_comparison.json")
    args = parser.parse_args()
    args.out_dir = Path(args.out_dir)
    specs = args.variant or list(VARIANTS)
    names = [variant_name(spec) for spec in specs]
    if len(set(names)) != len(names):
        parser.error(f"variant names must be unique, got {names}")

    train_missing(specs, args)

    scored = [str(bf16_drafter_folder(args.out_dir, name)) for name in names]
    missing = [path for path in scored if not Path(path).is_dir()]
    if missing:
        raise SystemExit(f"recipe_comparison: error: training did not save {missing}; see the log above")
    starts = [start for spec in specs if (start := starting_drafter(spec)) and start != args.reference]
    heldout = score_heldout([args.reference, *dict.fromkeys(starts), *scored], args, args.out_dir / "heldout.json")

    rows = []
    for spec, name, path in zip(specs, names, scored):
        log = json.loads((Path(path) / "gpu_training_log.json").read_text())
        cpu_hours = args.train_seconds / 3600  # one thread per variant for the whole budget
        tau = heldout[path]
        start = starting_drafter(spec)
        start_tau = heldout[start]["served_tau"] if start else 1.0  # from scratch: a drafter accepting nothing
        rows.append(
            {
                "variant": name,
                "spec": with_base(spec, args.base),
                "steps": log["steps"],
                "seconds_per_step": round(log["seconds_per_step_calibration"], 3),
                "chats_seen": log["steps"] * args.batch_size,
                "train_samples": log["train_samples"],
                "served_tau": tau["served_tau"],
                "all_anchor_tau": tau["all_anchor_tau"],
                "start_served_tau": start_tau,
                "served_gain_per_cpu_hour": round((tau["served_tau"] - start_tau) / cpu_hours, 3),
            }
        )
    reference = heldout[args.reference]
    print(f"\nheld out: the first {args.samples} chats of {args.eval_part}; budget {args.train_seconds:.0f} s on one "
          f"thread per variant, {args.batch_size} chats x {args.num_anchors} anchors per step\n")  # fmt: skip
    print("| variant | steps | s/step | chats seen | served-walk τ | all-anchor τ | τ gained per CPU-hour |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['variant']} | {row['steps']} | {row['seconds_per_step']:.2f} | {row['chats_seen']} | "
            f"{row['served_tau']:.3f} | {row['all_anchor_tau']:.3f} | {row['served_gain_per_cpu_hour']:.3f} |"
        )
    print(f"| reference {args.reference} | | | | {reference['served_tau']:.3f} | {reference['all_anchor_tau']:.3f} | |")
    write_result(args, {"variants": specs}, reference=reference, rows=rows)


if __name__ == "__main__":
    main()
