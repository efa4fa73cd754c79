"""The whole drafter pipeline on one GPU inside a wall-clock budget: regenerate, tokenize, train.

A GPU lent for a few minutes is worth more than days of CPU time, but only if nothing waits: this
script runs the package's own stages (`regenerate_responses`, `tokenize_responses`,
`train_from_config`) with the GPU kept busy and every stage bounded in time.

1. Regeneration: `--gen-workers` processes share the GPU (each a slice of the prompts; a decode step
   of a 135M target is launch-bound, so parallel processes multiply throughput). At the deadline the
   workers are stopped; their finished shards (written atomically) are the data.
2. Tokenization of every finished shard into one folder of `tokenized-*.jsonl`.
3. Training: each `--variant NAME:key=value,...` (DFlashConfig overrides, e.g. `L5:num_hidden_layers=5`;
   `training.` / `data.` keys reach those sections; grammar: `hf_dflash.trainer.variants`)
   trains in its own process, all at once. A variant first times 32 steps (`--calibration-steps`; the second half counts), then trains as many steps as
   its remaining time allows, so the cosine schedule ends exactly at the deadline.
   Concurrent variants each get an equal share of the GPU memory (a first run without the cap saw
   one variant's caching allocator hold 100 GiB and the other run out of memory).
4. Each drafter is saved Hub-native in bf16 under OUT/drafters/NAME-bf16, with its training log.

    python scripts/train_on_gpu.py --corpus out/gpu/corpus/prompts.jsonl --out /tmp/run \\
        --gen-seconds 200 --train-seconds 260 --variant L3:num_hidden_layers=3 --variant L5:num_hidden_layers=5

    # from the committed data, a recipe comparison (training.* / data.* keys reach those sections):
    python scripts/train_on_gpu.py --data data/smollm2-135m-instruct --eval-part regen-bf16-part2 --out /tmp/run \\
        --train-seconds 500 \\
        --variant L2:num_hidden_layers=2 --variant L2-V8k:num_hidden_layers=2,draft_vocab_size=8192 \\
        --variant L2-init:num_hidden_layers=2,init_from_target=true --variant L2-kl:num_hidden_layers=2,training.loss_type=kl

The same stages run on CPU through `hf-dflash prepare-data` and `hf-dflash train` (resumable).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from transformers import TrainerCallback

from hf_dflash.trainer.variants import bf16_drafter_folder, parse_variant


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def gen_worker(args: argparse.Namespace) -> None:
    """One regeneration process: the prompts `index::workers` into OUT/responses/wINDEX."""
    import torch

    from hf_dflash.data.regenerate import regenerate_responses
    from hf_dflash.json_files import read_jsonl
    from hf_dflash.targets import load_target

    prompts = list(read_jsonl(args.corpus))[args.index :: args.workers]
    model, tokenizer = load_target(args.target, dtype=torch.bfloat16)
    model.to(args.device)
    regenerate_responses(
        model,
        tokenizer,
        prompts,
        Path(args.out) / "responses" / f"w{args.index}",
        max_new_tokens=args.max_new_tokens,
        batch_size=args.gen_batch_size,
        shard_size=args.gen_batch_size,
        max_prompt_tokens=args.max_length - args.max_new_tokens,
        seed=args.index,
        progress=False,
    )


def regenerate(args: argparse.Namespace, deadline: float) -> None:
    command = [sys.executable, __file__, "gen-worker", *forwarded(args)]
    workers = [
        subprocess.Popen([*command, "--index", str(i), "--workers", str(args.gen_workers)])
        for i in range(args.gen_workers)
    ]
    while time.time() < deadline and any(worker.poll() is None for worker in workers):
        time.sleep(5)
        shards = len(list((Path(args.out) / "responses").glob("w*/responses-*.jsonl")))
        log(f"regeneration: {shards} shards of {args.gen_batch_size} prompts done")
    for worker in workers:
        if worker.poll() is None:
            worker.kill()
        worker.wait()


def tokenize_folder(target: str, responses: Path, out: Path, max_length: int, block_size: int) -> None:
    from hf_dflash.data.tokenize import tokenize_responses
    from hf_dflash.targets import load_target

    _, tokenizer = load_target(target)
    tokenize_responses(tokenizer, responses, out, max_length=max_length, block_size=block_size)


def tokenize(args: argparse.Namespace) -> Path:
    """Tokenize each worker's finished shards (in parallel); return the folder holding them all."""
    merged = Path(args.out) / "tokenized"
    merged.mkdir(parents=True, exist_ok=True)
    totals = {"samples": 0, "supervised_tokens": 0}
    workers = sorted((Path(args.out) / "responses").glob("w*"))
    for responses in workers:
        for partial in responses.glob(".*.tmp"):
            partial.unlink()  # a shard the deadline interrupted
    parts = [Path(args.out) / "tokenized-parts" / responses.name for responses in workers]
    with ProcessPoolExecutor(max(len(workers), 1)) as pool:
        n = len(workers)
        list(pool.map(tokenize_folder, [args.target] * n, workers, parts, [args.max_length] * n, [args.block_size] * n))
    for responses, folder in zip(workers, parts):
        for shard in sorted(folder.glob("tokenized-*.jsonl")):
            target = merged / f"tokenized-{responses.name}-{shard.name.removeprefix('tokenized-')}"
            shutil.copyfile(shard, target)
            for line in target.read_text().splitlines():
                sample = json.loads(line)
                totals["samples"] += 1
                totals["supervised_tokens"] += sum(sample["loss_mask"])
    (Path(args.out) / "data_summary.json").write_text(json.dumps(totals, indent=2))
    log(f"tokenized: {totals}")
    return merged


def variant_config(args: argparse.Namespace, name: str, overrides: dict, output_dir: Path, max_steps: int) -> dict:
    tokenized = args.data or str(Path(args.out) / "tokenized")  # committed packed data, or this run's own
    return {
        "target": args.target,
        "target_dtype": "auto",
        "drafter": dict(overrides["drafter"]),
        "data": {
            "tokenized": tokenized,
            "eval_samples": args.eval_samples,
            **({"eval_part": args.eval_part} if args.eval_part else {}),
            **overrides["data"],
        },
        "training": {
            "output_dir": str(output_dir),
            "block_size": args.block_size,
            "num_anchors": args.num_anchors,
            "per_device_train_batch_size": args.train_batch_size,
            "per_device_eval_batch_size": args.train_batch_size,
            "max_steps": max_steps,
            "bf16": train_in_bf16(args.device),
            "use_cpu": args.device == "cpu",
            "logging_steps": 10,
            "eval_strategy": "steps" if max_steps > args.calibration_steps else "no",
            "eval_steps": max(max_steps // 6, 1),
            "save_strategy": "no",
            "report_to": "none",
            "disable_tqdm": True,
            "dataloader_num_workers": 4,
            "seed": args.seed,
            **overrides["training"],
        },
    }


def train_in_bf16(device: str) -> bool:
    """bf16 autocast on a GPU, and on a CPU with native bf16 (AMX/avx512_bf16: 1.3x faster steps than
    fp32 on a 2-core Xeon); fp32 on CPUs without it, where bf16 is emulated and slow."""
    import torch

    from hf_dflash.dtypes import choose_dtype

    return not device.startswith("cpu") or choose_dtype("cpu").dtype == torch.bfloat16


class StepTimer(TrainerCallback):
    """Wall-clock time of each optimizer step's end."""

    def __init__(self):
        self.times: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.time())

    def seconds_per_step(self, skip: int) -> float:
        """Mean step time after the first `skip` steps (start-up: workers, kernels, allocator)."""
        times = self.times[skip:]
        return (times[-1] - times[0]) / (len(times) - 1)


def train_variant(args: argparse.Namespace) -> None:
    """One variant: time --calibration-steps steps, then train for the time left before --deadline."""
    import torch

    from hf_dflash.checkpoints import load_drafter
    from hf_dflash.trainer.train import train_from_config

    if args.device.startswith("cuda") and args.memory_fraction < 1:
        # Variants share the GPU: a cap makes each caching allocator release blocks before another OOMs.
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction)
    name, overrides = parse_variant(args.variant[0])
    root = Path(args.out) / "drafters"
    steps = overrides["training"].pop("max_steps", None)
    seconds_per_step = None
    if steps is None:  # a wall-clock budget: time a few steps, then fit the run into what is left
        timer = StepTimer()
        calibration = root / f"{name}-calibration"
        shutil.rmtree(calibration, ignore_errors=True)  # this script's own scratch run: a finished one would be skipped
        train_from_config(variant_config(args, name, overrides, calibration, args.calibration_steps), [timer])
        seconds_per_step = timer.seconds_per_step(skip=args.calibration_steps // 2)
        reserve = 45  # loading, final evaluation, saving
        steps = max(int((args.deadline - time.time() - reserve) / seconds_per_step), args.calibration_steps)
        log(f"{name}: {seconds_per_step:.3f} s/step -> {steps} steps")
    else:  # training.max_steps fixes the run (learning curves): no timing run, the budget does not apply
        log(f"{name}: {steps} steps (training.max_steps)")
    started = time.time()
    trainer = train_from_config(variant_config(args, name, overrides, root / name, steps))
    if trainer is None:  # a finished run of exactly this config (train_from_config said so): keep it
        return
    history = trainer.state.log_history
    summary = {
        "variant": name,
        "overrides": overrides,
        "steps": steps,
        "seconds_per_step_calibration": seconds_per_step,
        "train_seconds": time.time() - started,
        "train_samples": len(trainer.train_dataset),
        "eval": [entry for entry in history if "eval_tau" in entry],
        "eval_served": [entry for entry in history if "eval_served_tau" in entry],
        "train": [entry for entry in history if "tau" in entry],
    }
    (root / name / "gpu_training_log.json").write_text(json.dumps(summary, indent=2))
    drafter = load_drafter(root / name).to(torch.bfloat16)
    saved = bf16_drafter_folder(args.out, name)
    drafter.save_pretrained(saved)
    for extra in ("README.md", "training_record.json", "gpu_training_log.json"):
        if (root / name / extra).is_file():
            shutil.copyfile(root / name / extra, saved / extra)
    log(
        f"{name}: done, eval tau {[entry['eval_tau'] for entry in summary['eval']]}, served-walk tau "
        f"{[entry['eval_served_tau'] for entry in summary['eval_served']]}"
    )


def forwarded(args: argparse.Namespace) -> list[str]:
    """The shared options, for the worker processes."""
    return [
        *(["--corpus", args.corpus] if args.corpus else []), *(["--data", args.data] if args.data else []),
        "--out", args.out, "--target", args.target, "--device", args.device,
        "--max-new-tokens", str(args.max_new_tokens), "--max-length", str(args.max_length),
        "--gen-batch-size", str(args.gen_batch_size), "--block-size", str(args.block_size),
        "--num-anchors", str(args.num_anchors), "--train-batch-size", str(args.train_batch_size),
        "--eval-samples", str(args.eval_samples), "--seed", str(args.seed),
        "--calibration-steps", str(args.calibration_steps),
        *(["--eval-part", args.eval_part] if args.eval_part else []),
    ]  # fmt: skip


def main() -> None:
    from hf_dflash.modeling_dflash import DFlashConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", nargs="?", default="all", choices=("all", "gen-worker", "train-variant"))
    parser.add_argument("--corpus", default=None, help="prompts.jsonl of `hf-dflash prepare-data` (corpus stage)")
    parser.add_argument(
        "--data", default=None, help="train from this packed folder (e.g. data/smollm2-135m-instruct): no regeneration"
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--gen-workers", type=int, default=4)
    parser.add_argument("--gen-batch-size", type=int, default=384)
    parser.add_argument("--gen-seconds", type=float, default=200)
    parser.add_argument("--train-seconds", type=float, default=260)
    parser.add_argument(
        "--variant", action="append", default=None,
        help="NAME:key=value,... (DFlashConfig fields; training.key / data.key for those sections)",
    )  # fmt: skip
    parser.add_argument("--block-size", type=int, default=DFlashConfig.block_size)
    parser.add_argument("--num-anchors", type=int, default=128)
    parser.add_argument("--train-batch-size", type=int, default=32)
    parser.add_argument("--eval-samples", type=int, default=64)
    parser.add_argument(
        "--eval-part",
        default=None,
        help="with --data: hold out the first --eval-samples of this part (fixed as data grows)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--calibration-steps", type=int, default=32, help="steps timed first (the second half counts) to fit the budget"
    )
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--memory-fraction", type=float, default=1.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.corpus is None and args.data is None:
        parser.error("give --corpus (regenerate first) or --data (train from packed data)")
    if args.stage == "gen-worker":
        return gen_worker(args)
    if args.stage == "train-variant":
        return train_variant(args)

    from hf_dflash.targets import load_target

    started = time.time()
    load_target(args.target)  # convert the GGUF once, before the workers load the cached folder
    log(f"target ready in {time.time() - started:.0f} s")
    if args.data is None:
        regenerate(args, deadline=time.time() + args.gen_seconds)
        tokenize(args)
    else:
        log(f"training from the packed data in {args.data} (no regeneration)")
    deadline = time.time() + args.train_seconds
    variants = args.variant or ["L5:num_hidden_layers=5"]
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "train-variant",
                *forwarded(args),
                "--variant",
                spec,
                "--deadline",
                str(deadline),
                "--memory-fraction",
                str(0.9 / len(variants)),
            ]  # fmt: skip
        )
        for spec in variants
    ]
    codes = [process.wait() for process in processes]
    log(f"all done in {time.time() - started:.0f} s; exit codes {codes}")


if __name__ == "__main__":
    main()
