"""Tokenised training samples (`tokenized-*.jsonl` from `hf-dflash prepare-data`): checking one, and all of a folder."""

import json
from pathlib import Path

from torch.utils.data import Dataset


def validate_sample(sample: object, where: str, vocab_size: int | None = None) -> dict:
    """Check one `{"input_ids": [...], "loss_mask": [...]}` record; ValueError naming `where` otherwise."""
    if not isinstance(sample, dict) or "input_ids" not in sample or "loss_mask" not in sample:
        raise ValueError(f"{where}: expected an object with input_ids and loss_mask, got {str(sample)[:80]!r}.")
    ids, mask = sample["input_ids"], sample["loss_mask"]
    if len(ids) != len(mask):
        raise ValueError(f"{where}: input_ids has {len(ids)} tokens but loss_mask has {len(mask)}.")
    if set(mask) - {0, 1}:
        raise ValueError(f"{where}: loss_mask must hold only 0/1, found {sorted(set(mask) - {0, 1})}.")
    if vocab_size is not None and ids and not 0 <= min(ids) <= max(ids) < vocab_size:
        raise ValueError(
            f"{where}: token ids outside [0, {vocab_size}) (min {min(ids)}, max {max(ids)}): wrong target?"
        )
    return {"input_ids": ids, "loss_mask": mask}


class TokenizedDataset(Dataset):
    """All samples of the `tokenized-*.jsonl` shards of a folder, in file order."""

    def __init__(self, folder: str | Path, vocab_size: int | None = None):
        files = sorted(Path(folder).glob("tokenized-*.jsonl"))
        if not files:
            raise ValueError(f"No tokenized-*.jsonl shards in {folder}; create them with hf-dflash prepare-data.")
        self.samples = []
        for path in files:
            with path.open() as handle:
                for number, line in enumerate(handle, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as error:
                        raise ValueError(f"{path}:{number}: corrupt JSON ({error.msg}).") from None
                    self.samples.append(validate_sample(record, f"{path}:{number}", vocab_size))

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        return self.samples[index]
