"""Helpers shared by the offline feature cache tests: a tokenised folder of two files."""

import json
from pathlib import Path

# Two tokenised files, lengths 3..20 (batches mix lengths), one id that is not a safe tensor name.
SAMPLES = [
    [
        {"id": "a", "input_ids": [5, 17, 9], "loss_mask": [0, 1, 1]},
        {"id": "conv/7 #b", "input_ids": list(range(3, 23)), "loss_mask": [0] * 5 + [1] * 15},
        {"id": "c", "input_ids": [8, 4, 99, 100, 7, 7, 7], "loss_mask": [0, 0, 1, 1, 1, 1, 1]},
    ],
    [
        {"id": "d", "input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 1, 1, 1, 1]},
        {"id": "e", "input_ids": [127] * 12, "loss_mask": [1] * 12},
        {"id": "f", "input_ids": [60, 61, 62, 63, 64, 65, 66, 67, 68], "loss_mask": [0] * 4 + [1] * 5},
    ],
]


def write_tokenized(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for number, samples in enumerate(SAMPLES):
        lines = [json.dumps(sample) for sample in samples]
        (folder / f"tokenized-{number:05d}.jsonl").write_text("\n".join(lines) + "\n")
    return folder
