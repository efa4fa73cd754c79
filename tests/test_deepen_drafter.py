"""scripts/deepen_drafter.py: appended layers start as the identity, so the deeper drafter drafts as the source."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from hf_dflash.checkpoints import load_drafter
from hf_dflash.checkpoints.hub import save_hub
from hf_dflash.trainer.upgrade import deeper_drafter
from tests.conftest import make_drafter, make_target

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("deepen_drafter", ROOT / "scripts/deepen_drafter.py")
deepen = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = deepen
spec.loader.exec_module(deepen)


def draft_inputs(drafter, seed=0):
    """noise_embeds (1, q, H) and context_hidden_states (1, C, n*Ht) of one round."""
    config = drafter.config
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(1, config.block_size, config.hidden_size, generator=generator)
    context = torch.randn(1, 5, len(config.target_layer_ids) * config.target_hidden_size, generator=generator)
    return noise, context


@pytest.mark.parametrize(
    "overrides", [{}, {"sliding_window": 4, "layer_types": ["full_attention", "sliding_attention"]}]
)
def test_a_deepened_drafter_drafts_exactly_as_its_source(tmp_path, overrides):
    source = make_drafter(make_target("qwen3"), block_size=4, **overrides)
    with torch.no_grad():  # a "trained" drafter: no weight at its init value
        for parameter in source.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    path = save_hub(source, tmp_path / "source", dtype=torch.float32)
    out = deepen.deepen_drafter(str(path), tmp_path / "deep", add_layers=2)
    grown = load_drafter(out, dtype=torch.float32)
    assert grown.config.num_hidden_layers == 4
    assert grown.config.layer_types[2:] == [source.config.layer_types[-1]] * 2
    noise, context = draft_inputs(source)
    with torch.no_grad():
        expected = source(noise, context).last_hidden_state
        actual = grown(noise, context).last_hidden_state
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_the_new_layers_learn_from_the_first_step():
    """Zero output projections get gradients at once (a layer zeroed throughout would stay dead)."""
    grown = deeper_drafter(make_drafter(make_target("llama"), block_size=4), add_layers=1).train()
    noise, context = draft_inputs(grown)
    grown(noise, context).last_hidden_state.pow(2).sum().backward()
    new_layer = grown.layers[-1]
    assert new_layer.self_attn.o_proj.weight.grad.abs().sum() > 0
    assert new_layer.mlp.down_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("add_layers", [0, -1, 1.5, True])
def test_a_layer_count_that_is_not_a_positive_integer_is_refused(add_layers):
    with pytest.raises(ValueError, match="--add-layers"):
        deeper_drafter(make_drafter(make_target("llama")), add_layers)


def test_the_cli_refuses_to_write_over_a_folder_and_names_it(tmp_path, capsys):
    path = save_hub(make_drafter(make_target("llama")), tmp_path / "source")
    assert deepen.main([str(path), "--out", str(path)]) != 0
    assert "deepen_drafter.py: error:" in capsys.readouterr().err
