"""Oracle: `save_speculators` / `convert --to speculators` write vLLM speculators' layout, and our reader gives the
original drafter back (fp32: the same weights, the same hidden states and draft logits).

What speculators 0.9.0 reads (`DFlashSpeculatorConfig` / `DFlash2SpeculatorConfig`, `DraftVocabMixin`): the decoder in
`transformer_layer_config`, `aux_hidden_state_layer_ids` = our `target_layer_ids` + 1, the verifier's name or folder
(its loader takes the embedding, LM head and final norm from there), and for a pruned draft vocabulary
`lm_head.weight` = the target head's rows at the draft ids beside `t2d`/`d2t`. Its own `from_pretrained` on these
folders is the oracle in tests/test_engines.py (`make test-engines`).
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_dflash.checkpoints import convert, load_drafter, save_hub, save_speculators
from hf_dflash.cli import main
from tests.conftest import SUBSET, VOCAB, make_drafter, make_target, pruned_drafter

DFLASH2 = dict(conv_kernel_size=2, conv_group_size=8, selector_rank=6, selector_top_k=3)
VERIFIER = "tiny/llama-target"


def perturbed(drafter):
    """Every weight moved off its initial value (norms start at 1, DFlash2 parts at identity)."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    return drafter.eval()


@pytest.fixture(scope="module")
def target():
    return make_target("llama")


@pytest.fixture(scope="module")
def drafters(target):
    return {
        "dflash": perturbed(make_drafter(target)),
        "dflash_pruned": perturbed(pruned_drafter(target)),
        "dflash2": perturbed(make_drafter(target, **DFLASH2)),
    }


def outputs(drafter, target) -> tuple[torch.Tensor, torch.Tensor]:
    """(last_hidden_state (1, 4, H), draft logits (1, 4, V or draft_vocab_size)) on fixed block embeddings and 5
    context features."""
    generator = torch.Generator().manual_seed(1)
    noise = torch.randn(1, 4, 32, generator=generator)
    context = torch.randn(1, 5, 2 * 32, generator=generator)
    with torch.no_grad():
        hidden = drafter(noise_embeds=noise, context_hidden_states=context).last_hidden_state
        return hidden, drafter.draft_logits(hidden, target.lm_head, full_vocab=False)


@pytest.mark.parametrize("kind", ["dflash", "dflash_pruned", "dflash2"])
def test_the_export_is_speculators_layout_and_reads_back_the_same(target, drafters, kind, tmp_path):
    drafter = drafters[kind]
    folder = save_speculators(drafter, tmp_path / kind, verifier=VERIFIER, target_lm_head=target)
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == ("dflash2" if kind == "dflash2" else "dflash")
    assert config["aux_hidden_state_layer_ids"] == [i + 1 for i in drafter.config.target_layer_ids] == [2, 4]
    assert config["mask_token_id"] == drafter.config.mask_token_id and config["block_size"] == 4
    assert config["transformer_layer_config"]["vocab_size"] == VOCAB
    assert config["transformer_layer_config"]["num_hidden_layers"] == 2
    assert config["speculators_config"]["verifier"] == {"name_or_path": VERIFIER, "architectures": []}
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    weights = load_file(str(folder / "model.safetensors"))
    assert "embed_tokens.weight" not in weights  # speculators reads it from the verifier
    if kind == "dflash_pruned":
        assert config["draft_vocab_size"] == len(SUBSET) and config["draft_lm_head"] == "target_rows"
        assert torch.equal(weights.pop("lm_head.weight"), target.lm_head.weight[SUBSET])
        assert torch.equal(torch.arange(len(SUBSET)) + weights["d2t"], torch.tensor(SUBSET))
    else:
        assert config["draft_vocab_size"] == VOCAB and "lm_head.weight" not in weights
    if kind == "dflash2":
        assert {config[field] for field in DFLASH2} == set(DFLASH2.values()) and len(DFLASH2) == 4
    assert weights.keys() == drafter.state_dict().keys()

    loaded = load_drafter(folder)  # the export records the target's depth: no num_target_layers needed
    assert loaded.config.num_target_layers == 6 and loaded.config.target_layer_ids == [1, 3]
    assert loaded.config.draft_vocab_size == drafter.config.draft_vocab_size
    for ours, back in zip(outputs(drafter, target), outputs(loaded, target), strict=True):
        assert (ours - back).abs().max() < 1e-5


def test_convert_cli_names_a_local_target_folder_as_the_verifier(target, drafters, tmp_path, capsys):
    target.save_pretrained(tmp_path / "target")
    source = save_hub(drafters["dflash_pruned"], tmp_path / "hub")
    out = tmp_path / "speculators"
    assert main(["convert", str(source), str(out), "--to", "speculators", "--target", str(tmp_path / "target")]) == 0
    assert "Wrote speculators DFlash checkpoint" in capsys.readouterr().out
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str((tmp_path / "target").resolve()), "architectures": ["LlamaForCausalLM"]}
    for ours, back in zip(outputs(drafters["dflash_pruned"], target), outputs(load_drafter(out), target), strict=True):
        assert (ours - back).abs().max() < 1e-5


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(draft_vocab_size=len(SUBSET), **DFLASH2), r"DFlash2 with a pruned draft vocabulary"),
        (dict(target_hidden_size=16), r"target_hidden_size=16 differs from hidden_size=32"),
        (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=4), r"sliding-window layers"),
        (dict(output_multiplier=2.0), r"no \['output_multiplier'\] transform"),
    ],
    ids=["dflash2_pruned", "target_hidden_size", "sliding_window", "output_multiplier"],
)
def test_what_speculators_cannot_run_is_refused_by_name_before_writing(target, overrides, match, tmp_path):
    drafter = make_drafter(target, **overrides)
    with pytest.raises(ValueError, match=match):
        save_speculators(drafter, tmp_path / "direct", verifier=VERIFIER, target_lm_head=target)
    source = save_hub(drafter, tmp_path / "hub")
    with pytest.raises(ValueError, match=match):
        convert(source, tmp_path / "converted", to="speculators", target=target)
    assert not (tmp_path / "direct").exists() and not (tmp_path / "converted").exists()


def test_the_verifier_and_a_pruned_vocabularys_head_are_required(target, drafters, tmp_path):
    source = save_hub(drafters["dflash"], tmp_path / "hub")
    with pytest.raises(ValueError, match=r"names its verifier.*--target"):
        convert(source, tmp_path / "no-target", to="speculators")
    with pytest.raises(ValueError, match=r"pruned draft vocabulary.*--target"):
        save_speculators(drafters["dflash_pruned"], tmp_path / "no-head", verifier=VERIFIER)
    assert not (tmp_path / "no-target").exists() and not (tmp_path / "no-head").exists()


def test_a_reduced_vocabulary_is_read_only_as_the_targets_rows(target, drafters, tmp_path):
    folder = save_speculators(drafters["dflash_pruned"], tmp_path / "pruned", verifier=VERIFIER, target_lm_head=target)
    config = json.loads((folder / "config.json").read_text())
    config.pop("draft_lm_head")
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"draft_vocab_size=49 is a reduced vocabulary.*draft_lm_head"):
        load_drafter(folder)
    config["draft_lm_head"] = "target_rows"
    (folder / "config.json").write_text(json.dumps(config))
    weights = load_file(str(folder / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"][:5]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lm_head.weight of shape \[draft_vocab_size, hidden_size\] = \[49, 32\]"):
        load_drafter(folder)
