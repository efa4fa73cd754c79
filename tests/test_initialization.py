"""init_from_target: draft layers start as copies of target layers; fc passes the deepest feature through."""

import pytest
import torch

from hf_dflash.trainer.initialization import init_from_target
from hf_dflash.trainer.train import load_train_config, train_from_config
from tests.conftest import make_drafter, make_target


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_layers_norm_and_fc_are_copied(arch):
    target = make_target(arch)
    drafter = make_drafter(target, num_hidden_layers=2)  # features [1, 3] of 6 target layers
    assert init_from_target(drafter, target) == [4, 5]
    for draft_layer, source in zip(drafter.layers, target.model.layers[4:]):
        assert torch.equal(draft_layer.self_attn.q_proj.weight, source.self_attn.q_proj.weight)
        assert torch.equal(draft_layer.mlp.down_proj.weight, source.mlp.down_proj.weight)
        assert torch.equal(draft_layer.input_layernorm.weight, source.input_layernorm.weight)
        if arch == "qwen3":
            assert torch.equal(draft_layer.self_attn.k_norm.weight, source.self_attn.k_norm.weight)
    assert torch.equal(drafter.norm.weight, target.model.norm.weight)
    hidden = target.config.hidden_size
    features = torch.randn(1, 3, 2 * hidden)
    torch.testing.assert_close(drafter.fc(features), features[..., hidden:])  # layer 3 is the deepest feature


def test_explicit_source_layers_and_bad_ones():
    target = make_target("llama")
    drafter = make_drafter(target, num_hidden_layers=2)
    assert init_from_target(drafter, target, [0, 2]) == [0, 2]
    assert torch.equal(drafter.layers[1].self_attn.v_proj.weight, target.model.layers[2].self_attn.v_proj.weight)
    with pytest.raises(ValueError, match=r"must name 2 target layers .* in \[0, 6\)"):
        init_from_target(drafter, target, [0, 6])
    with pytest.raises(ValueError, match="must name 2 target layers"):
        init_from_target(drafter, target, [1])


def test_training_config_can_start_from_target_layers(run_config):  # noqa: F811
    config = load_train_config(run_config)
    config["drafter"]["init_from_target"] = True
    config["training"].update(max_steps=1, eval_strategy="no", save_strategy="no")
    trainer = train_from_config(config)
    assert trainer.state.global_step == 1
