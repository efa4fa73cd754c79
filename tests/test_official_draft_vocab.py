"""The official export of a drafter with a pruned draft vocabulary (issue 52): what vLLM's `method="dflash"` reads.

vLLM 0.32's `DFlashQwen3ForCausalLM` builds its head with `draft_vocab_size` rows, loads it from the checkpoint's
`lm_head.weight` (without one it takes the target's whole head and keeps its first `draft_vocab_size` rows), maps
the checkpoint's `d2t` to `draft_id_to_target_id`, skips `t2d`, and scatters the N logits to `arange(N) + d2t`
(-inf elsewhere). So the export must hold the target head's rows at the draft ids as `lm_head.weight`. Oracle
here: those logits, scattered as vLLM does, equal our drafter's draft logits; the engine itself is the oracle in
tests/test_engines.py (`make test-engines`). Loading the folder back (our loader, the remote code) drops the
head (the target lends it at run time) only where the config says it is the target's rows.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel

from hf_dflash.checkpoints import convert, load_drafter, save_hub, save_official
from hf_dflash.checkpoints.official import DRAFT_HEAD_FIELD, DRAFT_HEAD_TARGET_ROWS
from hf_dflash.cli import main
from tests.conftest import SUBSET, VOCAB, make_target, pruned_drafter


@pytest.fixture(scope="module")
def pair():
    target = make_target("llama")
    return target, pruned_drafter(target)


def engine_logits(folder, hidden: torch.Tensor) -> torch.Tensor:
    """vLLM's DFlash compute_logits on an exported folder: the checkpoint head's N logits at arange(N) + d2t."""
    weights = load_file(str(folder / "model.safetensors"))
    size = json.loads((folder / "config.json").read_text())["draft_vocab_size"]
    logits = hidden @ weights["lm_head.weight"].T
    full = logits.new_full((hidden.shape[0], VOCAB), float("-inf"))
    full[:, torch.arange(size) + weights["d2t"]] = logits
    return full


def test_the_export_holds_the_target_heads_rows_at_the_draft_ids(pair, tmp_path):
    target, drafter = pair
    folder = save_official(drafter, tmp_path / "official", target_lm_head=target.lm_head)
    weights = load_file(str(folder / "model.safetensors"))
    ids = torch.tensor(SUBSET)
    assert torch.equal(weights["lm_head.weight"], target.lm_head.weight[ids])
    assert torch.equal(torch.arange(len(SUBSET)) + weights["d2t"], ids)
    config = json.loads((folder / "config.json").read_text())
    assert config["draft_vocab_size"] == len(SUBSET) and config["vocab_size"] == VOCAB
    assert config[DRAFT_HEAD_FIELD] == DRAFT_HEAD_TARGET_ROWS
    hidden = torch.randn(3, target.config.hidden_size)
    torch.testing.assert_close(engine_logits(folder, hidden), drafter.draft_logits(hidden, target.lm_head))


def test_a_tensor_head_and_a_cast_are_taken(pair, tmp_path):
    target, drafter = pair
    folder = save_official(drafter, tmp_path / "bf16", dtype="bfloat16", target_lm_head=target.lm_head.weight)
    head = load_file(str(folder / "model.safetensors"))["lm_head.weight"]
    assert head.dtype == torch.bfloat16 and torch.equal(head, target.lm_head.weight[SUBSET].bfloat16())


def test_without_the_target_head_the_export_is_refused_by_name(pair, tmp_path):
    target, drafter = pair
    with pytest.raises(ValueError, match="target_lm_head"):
        save_official(drafter, tmp_path / "none")
    assert not (tmp_path / "none").exists()
    wrong = torch.nn.Linear(target.config.hidden_size, VOCAB - 1, bias=False)
    with pytest.raises(ValueError, match=r"\[127, 32\]"):
        save_official(drafter, tmp_path / "wrong", target_lm_head=wrong)


def test_the_folder_loads_back_without_the_head(pair, tmp_path):
    target, drafter = pair
    folder = save_official(drafter, tmp_path / "official", target_lm_head=target.lm_head)
    hidden = torch.randn(1, 2, target.config.hidden_size)
    for loaded in (load_drafter(folder), AutoModel.from_pretrained(folder, trust_remote_code=True)):
        assert "lm_head.weight" not in loaded.state_dict()
        assert loaded.draft_token_ids.tolist() == SUBSET
        assert torch.equal(loaded.draft_logits(hidden, target.lm_head), drafter.draft_logits(hidden, target.lm_head))


def test_a_head_the_config_does_not_call_the_targets_rows_is_refused(pair, tmp_path):
    """A draft head trained on its own (not the target's rows) would be dropped silently: refused by name."""
    target, drafter = pair
    folder = save_official(drafter, tmp_path / "official", target_lm_head=target.lm_head)
    config = json.loads((folder / "config.json").read_text())
    del config[DRAFT_HEAD_FIELD]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=DRAFT_HEAD_FIELD):
        load_drafter(folder)
    with pytest.raises(ValueError, match=DRAFT_HEAD_FIELD):
        AutoModel.from_pretrained(folder, trust_remote_code=True)


def test_a_head_of_the_wrong_shape_is_named(pair, tmp_path):
    target, drafter = pair
    folder = save_official(drafter, tmp_path / "official", target_lm_head=target.lm_head)
    weights = load_file(str(folder / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"][:-1].clone()
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_drafter(folder)


def test_convert_and_export_take_the_target(pair, tmp_path, capsys):
    target, drafter = pair
    hub = save_hub(drafter, tmp_path / "hub")
    target_dir = tmp_path / "target"
    target.save_pretrained(target_dir)
    assert main(["convert", str(hub), str(tmp_path / "no-target"), "--to", "official"]) == 2
    assert "--target" in capsys.readouterr().err
    assert main(["convert", str(hub), str(tmp_path / "cli"), "--to", "official", "--target", str(target_dir)]) == 0
    written = load_file(str(tmp_path / "cli" / "model.safetensors"))["lm_head.weight"]
    assert torch.equal(written, target.lm_head.weight[SUBSET])
    assert convert(hub, tmp_path / "api", to="official", target=target) == tmp_path / "api"
    argv = ["export", str(hub), str(tmp_path / "repo"), "--target-id", "me/tiny", "--official"]
    assert main(argv) == 2 and "--target" in capsys.readouterr().err
    assert not any(p.suffix in (".json", ".safetensors", ".md") for p in (tmp_path / "repo").rglob("*"))
    assert main([*argv, "--target", str(target_dir)]) == 0
    exported = load_file(str(tmp_path / "repo" / "official" / "model.safetensors"))["lm_head.weight"]
    assert torch.equal(exported, target.lm_head.weight[SUBSET])
    assert "lm_head.weight" not in load_file(str(tmp_path / "repo" / "model.safetensors"))  # Hub-native: no copy


def test_a_known_targets_hub_id_loads_that_target_in_fp32(pair, monkeypatch):
    """The card's convert command names the target by its Hub id: a known target's id loads the packaged target."""
    import hf_dflash.targets as targets
    from hf_dflash.checkpoints.converting import official_head_source

    target, drafter = pair
    calls = []
    monkeypatch.setattr(targets, "load_any_target", lambda name, dtype: calls.append((name, dtype)) or (target, None))
    assert official_head_source(drafter, "HuggingFaceTB/SmolLM2-135M-Instruct") is target
    assert calls == [("smollm2-135m-instruct", torch.float32)]
    assert official_head_source(drafter, target) is target and len(calls) == 1
