"""The data committed in `data/`: every shard intact and counted as its manifest says (the training chats, and the
target's replies to unseen bench prompts that drafters are scored on)."""

from collections import Counter
from pathlib import Path

import pytest

from hf_dflash.data.packed import PackedDataset, read_manifest, source_of

DATA = Path(__file__).resolve().parent.parent / "data"
FOLDERS = [
    "smollm2-135m-instruct",
    "gemma3-270m",
    *(f"smollm2-135m-instruct-unseen/{kind}" for kind in ("greedy", "chat-t0.7", "creative")),
    *(f"gemma3-270m-unseen/{kind}" for kind in ("greedy", "creative")),
]


@pytest.fixture(scope="module", params=FOLDERS)
def committed(request):
    folder = DATA / request.param
    manifest = read_manifest(folder)
    return PackedDataset(folder, vocab_size=manifest["tokenizer"]["vocab_size"]), manifest  # checks every sha256


def test_the_committed_data_matches_its_manifest(committed):
    dataset, manifest = committed
    totals = manifest["totals"]
    assert len(dataset) == totals["samples"] == sum(shard["samples"] for shard in manifest["shards"])
    assert sum(len(sample["input_ids"]) for sample in dataset) == totals["tokens"]
    assert sum(sum(sample["loss_mask"]) for sample in dataset) == totals["supervised_tokens"]
    assert dict(Counter(source_of(sample["id"]) for sample in dataset)) == totals["per_source"]
    assert len({sample["id"] for sample in dataset}) == len(dataset)  # no chat packed twice
    assert set(dataset.parts) == set(manifest["parts"])
    for part in manifest["parts"].values():  # each part says how it was made
        assert {"regeneration", "tokenization", "note"} <= set(part["settings"])


def test_every_committed_sample_is_trainable(committed):
    """Each sample within its part's tokenized length (1,024; the long-prompt part 4,096)."""
    dataset, manifest = committed
    limits = {name: part["settings"]["tokenization"]["max_length"] for name, part in manifest["parts"].items()}
    assert max(limits.values()) <= 4096
    for sample, part in zip(dataset, dataset.parts):
        assert len(sample["input_ids"]) == len(sample["loss_mask"]) <= limits[part]
        assert sum(sample["loss_mask"]) >= 16 and max(sample["input_ids"]) < manifest["tokenizer"]["vocab_size"]
