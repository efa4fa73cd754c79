"""Helpers shared by the training tests: random tokenised samples, trainer arguments, a tokenised folder."""

import json

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
