"""scripts/average_drafters.py: the mean of drafters' weights, one architecture, a new output folder."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from hf_dflash.checkpoints import load_drafter
from hf_dflash.checkpoints.hub import save_hub
from tests.conftest import make_drafter, make_target

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("average_drafters", ROOT / "scripts/average_drafters.py")
average = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = average
spec.loader.exec_module(average)


def saved_drafters(tmp_path, target, count=2, **overrides):
    paths = []
    for index in range(count):
        drafter = make_drafter(target, block_size=4, **overrides)
        generator = torch.Generator().manual_seed(index)
        with torch.no_grad():  # two "training cycles" from one starting point
            for parameter in drafter.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.01)
        paths.append(save_hub(drafter, tmp_path / f"drafter{index}"))
    return paths


def test_the_mean_of_two_drafters_is_their_weights_mean(tmp_path):
    target = make_target("llama")
    paths = saved_drafters(tmp_path, target)
    out = average.average_drafters([str(p) for p in paths], tmp_path / "soup", dtype="float32")
    soup = load_drafter(out, dtype=torch.float32).state_dict()
    first, second = (load_drafter(p, dtype=torch.float32).state_dict() for p in paths)
    for key in soup:
        torch.testing.assert_close(soup[key], (first[key] + second[key]) / 2)
    assert any(not torch.equal(first[key], second[key]) for key in first)  # two different drafters


def test_the_mean_keeps_the_training_record_and_names_what_it_averaged(tmp_path):
    """A mean shipped with `hf-dflash export` carries a record: the last source's run, and every source's weights."""
    import json

    from hf_dflash.hub_cards.schemas import load_training_record

    target = make_target("llama")
    paths = saved_drafters(tmp_path, target)
    record = {"data_sources": {"tokenized": 8}, "hyperparameters": {"block_size": 4}, "training_time_s": 12.0}
    (paths[1] / "training_record.json").write_text(json.dumps(record))
    out = average.average_drafters([str(p) for p in paths], tmp_path / "soup", dtype="float32")
    written = load_training_record(out / "training_record.json")
    assert {key: written[key] for key in record} == record
    assert written["averaged_from"] == [
        {"path": str(path), "weights_sha256": average.file_sha256(path / "model.safetensors")} for path in paths
    ]
    bare = average.average_drafters([str(paths[0]), str(paths[0])], tmp_path / "bare", dtype="float32")
    assert not (bare / "training_record.json").exists()  # no source has a record: none is made up


def test_other_architectures_and_existing_folders_are_refused(tmp_path):
    target = make_target("llama")
    paths = saved_drafters(tmp_path, target)
    other = save_hub(make_drafter(target, block_size=8), tmp_path / "other")
    with pytest.raises(ValueError, match="block_size=8"):
        average.average_drafters([str(paths[0]), str(other)], tmp_path / "soup")
    with pytest.raises(ValueError, match="not empty"):
        average.average_drafters([str(p) for p in paths], paths[0].parent / "drafter1")
    assert average.main([str(paths[0])] + ["--out", str(tmp_path / "one")]) == 2  # one drafter: a user error


def test_drafters_with_other_draft_vocabularies_are_refused_by_name(tmp_path):
    """Same architecture and draft_vocab_size, other ids: the mean of d2t/t2d is no vocabulary (issue 53)."""
    target = make_target("llama")
    paths = []
    for index in range(2):
        drafter = make_drafter(target, block_size=4, draft_vocab_size=32)
        drafter.set_draft_vocab(torch.randperm(128, generator=torch.Generator().manual_seed(index))[:32])
        paths.append(save_hub(drafter, tmp_path / f"drafter{index}"))
    with pytest.raises(ValueError, match=r"drafter1 drafts over another draft vocabulary than .*drafter0") as refusal:
        average.average_drafters([str(p) for p in paths], tmp_path / "soup")
    assert "d2t" in str(refusal.value) and not (tmp_path / "soup").exists()
    assert average.main([str(p) for p in paths] + ["--out", str(tmp_path / "soup")]) == 2
