"""Oracle: `expand_draft_vocabulary` (hf_dflash/checkpoints/vocabulary.py) turns a drafter with a pruned draft
vocabulary into one over the target's whole vocabulary whose logits at the draft ids are the pruned drafter's,
exactly (fp32, tiny random models); `convert --expand-vocabulary` / `export --official --expand-vocabulary` write it
as the official (vLLM) and speculators layouts of a pruned DFlash2 drafter, which are refused without the flag."""

import json

import pytest
import torch
from safetensors.torch import load_file

from hf_dflash.checkpoints import (
    OFFICIAL_SUBFOLDER,
    convert,
    expand_draft_vocabulary,
    export_drafter,
    load_drafter,
    save_hub,
)
from hf_dflash.cli import main
from tests.conftest import SUBSET, VOCAB, make_target, pruned_drafter
from tests.test_dflash2_serving import dflash2_drafter

TARGET_ID = "tiny/llama-target"


@pytest.fixture(scope="module")
def target():
    return make_target("qwen3")


@pytest.fixture(scope="module")
def drafters(target):
    """A pruned DFlash drafter and a pruned DFlash2 drafter whose selector re-ranks its candidates."""
    return {"dflash": pruned_drafter(target), "dflash2": dflash2_drafter(target, draft_vocab_size=24)}


def block_outputs(drafter, target) -> torch.Tensor:
    """The drafter's last hidden states (1, 4, H) on fixed block embeddings and 5 context features."""
    generator = torch.Generator().manual_seed(1)
    noise = torch.randn(1, 4, 32, generator=generator)
    context = torch.randn(1, 5, 2 * 32, generator=generator)
    with torch.no_grad():
        return drafter(noise_embeds=noise, context_hidden_states=context).last_hidden_state


def check_expanded(pruned, expanded, target) -> None:
    """`expanded` drafts over the whole vocabulary with `pruned`'s weights; its logits at the draft ids are
    `pruned`'s and elsewhere the target head's (where `pruned` has -inf)."""
    assert expanded.config.draft_vocab_size is None and expanded.draft_token_ids is None
    assert "d2t" not in expanded.state_dict() and "t2d" not in expanded.state_dict()
    weights = {key: value for key, value in pruned.state_dict().items() if key not in ("d2t", "t2d")}
    assert weights.keys() == expanded.state_dict().keys()
    assert all(torch.equal(value, expanded.state_dict()[key]) for key, value in weights.items())
    hidden = block_outputs(pruned, target)
    assert torch.equal(hidden, block_outputs(expanded, target))
    with torch.no_grad():
        ours = pruned.draft_logits(hidden, target.lm_head)  # (1, 4, V): -inf off the draft ids
        full = expanded.draft_logits(hidden, target.lm_head)
    ids = pruned.draft_token_ids
    assert full.shape[-1] == VOCAB and torch.equal(full[..., ids], ours[..., ids])
    assert torch.equal(full, target.lm_head(hidden)) and bool(torch.isfinite(full).all())


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_the_expanded_drafter_scores_the_draft_ids_as_the_pruned_one(target, drafters, kind):
    pruned = drafters[kind]
    expanded = expand_draft_vocabulary(pruned)
    check_expanded(pruned, expanded, target)
    if kind == "dflash2":  # the selector's codebooks were already over the whole vocabulary, by target id
        assert expanded.candidate_selector.predecessor_codebook.shape[0] == VOCAB
    assert pruned.config.draft_vocab_size is not None and pruned.draft_token_ids is not None  # left as it was


def test_expanding_a_whole_vocabulary_drafter_is_refused_by_name(target, drafters):
    whole = expand_draft_vocabulary(drafters["dflash2"])
    with pytest.raises(ValueError, match=r"draft_vocab_size=None.*drop --expand-vocabulary"):
        expand_draft_vocabulary(whole)


@pytest.mark.parametrize("to", ["official", "speculators"])
def test_convert_expands_a_pruned_dflash2_drafter_only_when_asked(target, drafters, to, tmp_path):
    pruned = drafters["dflash2"]
    source = save_hub(pruned, tmp_path / "hub")
    target.save_pretrained(tmp_path / "target")
    verifier = str(tmp_path / "target")
    refusal = "has no official layout as trained" if to == "official" else "DFlash2 with a pruned draft vocabulary"
    with pytest.raises(ValueError, match=rf"{refusal}.*--expand-vocabulary"):
        convert(source, tmp_path / "refused", to=to, target=verifier)
    assert not (tmp_path / "refused").exists()

    out = tmp_path / to
    assert main(["convert", str(source), str(out), "--to", to, "--target", verifier, "--expand-vocabulary"]) == 0
    weights = load_file(out / "model.safetensors")
    assert not {"d2t", "t2d", "lm_head.weight"} & set(weights)  # the target lends its whole head
    config = json.loads((out / "config.json").read_text())
    assert config.get("draft_vocab_size", VOCAB) == VOCAB  # speculators states the whole vocabulary's size
    if to == "official":
        assert config["architectures"] == ["DFlash2DraftModel"] and config["vocab_size"] == VOCAB
    check_expanded(pruned, load_drafter(out), target)


def test_export_expands_only_the_official_copy_and_the_card_says_so(target, drafters, tmp_path, capsys):
    pruned = drafters["dflash2"]
    source = save_hub(pruned, tmp_path / "drafter")
    with pytest.raises(ValueError, match=r"changes only the official/ copy: pass official=True"):
        export_drafter(source, tmp_path / "no-official", TARGET_ID, expand_vocabulary=True)
    assert main(["export", str(source), str(tmp_path / "refused"), "--target-id", TARGET_ID, "--official"]) == 2
    assert "--expand-vocabulary" in capsys.readouterr().err

    out = tmp_path / "repo"
    argv = ["export", str(source), str(out), "--target-id", TARGET_ID, "--official", "--expand-vocabulary"]
    assert main(argv) == 0
    assert load_drafter(out).config.draft_vocab_size == 24  # the Hub-native weights stay as trained
    check_expanded(pruned, load_drafter(out / OFFICIAL_SUBFOLDER), target)
    card = (out / "README.md").read_text()
    assert "expanded to the target's whole vocabulary" in card and "no engine layout" not in card
    assert "sglang.launch_server" not in card  # SGLang has no DFlash2 model


def test_the_card_of_a_pruned_dflash2_drafter_names_the_expansion(drafters, tmp_path):
    out = export_drafter(save_hub(drafters["dflash2"], tmp_path / "drafter"), tmp_path / "repo", TARGET_ID)
    card = (out / "README.md").read_text()
    assert "no engine layout as trained" in card and "--to official --expand-vocabulary" in card
    assert len(SUBSET) != 24  # the DFlash2 drafter's own 24 ids, not the conftest subset
