"""Helpers shared by the training tests: random tokenised samples, trainer arguments, a tokenised folder."""

import json
import os
import socket
import subprocess
import sys

import torch

from hf_dflash.trainer import DFlashTrainingArguments

BLOCK = 4


def samples(count=8, length=24, seed=0):
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        size = length - (i % 3) * 4
        prompt = 6 + i % 4
        ids = torch.randint(3, 128, (size,), generator=generator).tolist()
        out.append({"input_ids": ids, "loss_mask": [0] * prompt + [1] * (size - prompt)})
    return out


def arguments(tmp_path, **overrides):
    fields = dict(
        output_dir=str(tmp_path / "run"),
        block_size=BLOCK,
        num_anchors=6,
        per_device_train_batch_size=2,
        learning_rate=3e-3,
        warmup_steps=0,
        num_train_epochs=1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_drop_last=True,
    )
    return DFlashTrainingArguments(**(fields | overrides))


def write_tokenized(folder, rows):
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "tokenized-00000.jsonl").open("w") as handle:
        for i, row in enumerate(rows):
            handle.write(json.dumps({"id": f"s{i}", **row}) + "\n")


# two gloo processes on CPU: --multi_gpu selects the torch.distributed launcher, use_cpu=True in the arguments makes it gloo
TWO_CPU_PROCESSES = (
    "--multi_gpu",
    "--num_processes",
    "2",
    "--num_machines",
    "1",
    "--mixed_precision",
    "no",
    "--dynamo_backend",
    "no",
)


def accelerate_launcher(*options: str) -> list[str]:
    """argv that runs `accelerate launch OPTIONS` on a port of its own. Without one every launch asks for 29500 and
    falls back to another only if 29500 is busy when it checks: two tests launching at the same moment on
    pytest-xdist workers can both pass the check and share one rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(port), *options]


def run_worker(argv: list[str], **kwargs) -> None:
    """Run a worker process (plain or launched); a failure fails the test with the worker's own output (pytest
    otherwise shows a bare CalledProcessError, and CI's log keeps only its tail)."""
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300, **kwargs)
    if run.returncode != 0:
        raise AssertionError(f"{argv} exited {run.returncode}:\n{run.stdout[-2000:]}\n{run.stderr[-6000:]}")


def finish_launched_worker() -> None:
    """End a worker of `accelerate launch` once every file is written: a barrier, then exit without the interpreter's
    teardown, where the gloo group aborted a rank (torch 2.13: "terminate called without an active exception",
    SIGABRT) and `destroy_process_group()` once hung for 300 s, both in full test runs on a 2-core AMD EPYC
    (2026-12-07). A plain single process returns."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def packed_equals_served(trained, served, target, block_size: int) -> float:
    """Max |packed training forward of `trained` - one block at a time through `served`| over the blocks of a
    batch of `block_size` blocks, 2 chats of up to 40 tokens (fp32): the function trained is the one served."""
    from hf_dflash.trainer import DFlashDataCollator, compute_target_features
    from hf_dflash.trainer.forward import dflash_training_forward

    collate = DFlashDataCollator(block_size, num_anchors=5, mask_token_id=served.config.mask_token_id, gamma=3.0)
    batch = collate(samples(count=2, length=40, seed=5))
    features = compute_target_features(
        target, batch["input_ids"], served.config.target_layer_ids, batch["attention_mask"]
    )
    embedding, worst = target.get_input_embeddings(), 0.0
    with torch.no_grad():
        packed = dflash_training_forward(trained, embedding, batch, features, trained.config)
        for row, anchor in batch["anchor_valid"].nonzero().tolist():
            p, block = (
                int(batch["anchor_positions"][row, anchor]),
                slice(anchor * block_size, (anchor + 1) * block_size),
            )
            one = served(
                noise_embeds=embedding(batch["block_ids"][row : row + 1, block]),
                context_hidden_states=features[row : row + 1, :p],
                position_ids=torch.arange(p + block_size)[None],
            ).last_hidden_state
            worst = max(worst, float((one - packed[row : row + 1, block]).abs().max()))
    return worst
