"""DFlash2 (issue 34, part 1; docs/dflash2.md): the config fields and their checks, the grouped dynamic
convolution (block only, nothing across a block boundary, the context never convolved), identity
initialisation (= the DFlash outputs), the official folder read and written back unchanged, and the
selector walk against hand-computed oracles."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from hf_dflash import DFlashConfig, DFlashDraftModel
from hf_dflash.checkpoints import convert, drafter_from_model, load_drafter, save_hub, save_official
from hf_dflash.generation.drafting.selector import selector_chain
from hf_dflash.modeling_dflash.modeling_dflash import grouped_dynamic_conv, selector_walk, unary_top_k
from hf_dflash.trainer.upgrade import dflash2_from_dflash

V1 = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_target_layers=6,
    target_layer_ids=[1, 3],
    mask_token_id=127,
    block_size=4,
    max_position_embeddings=256,
)
V2_FIELDS = dict(conv_kernel_size=2, conv_group_size=8, selector_rank=6, selector_top_k=3)
# A DFlash (v1) drafter's config.json as written by hf-dflash export (SmolLM2 drafter v5, shipped 2026-12-03)
DFLASH_V5 = Path(__file__).resolve().parent / "fixtures" / "dflash-v5"


def perturbed(model: DFlashDraftModel, seed: int = 0, only_dflash2: bool = False) -> DFlashDraftModel:
    """Every weight (or only the DFlash2 parts) moved off its initial value, so a swapped or unused one shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if not only_dflash2 or "_conv." in name or name.startswith("candidate_selector."):
                parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator).to(parameter.dtype))
    return model.eval()


def block_inputs(seed: int = 1, batch: int = 1, context: int = 5) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        "noise_embeds": torch.randn(batch, V1["block_size"], 32, generator=generator),
        "context_hidden_states": torch.randn(batch, context, 2 * 32, generator=generator),
    }


def outputs(model: DFlashDraftModel, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(**inputs).last_hidden_state


# ---------------------------------------------------------------- the config


def test_a_dflash_config_json_is_unchanged(tmp_path):
    """No DFlash2 field or transform is written for a DFlash drafter: a v1 config.json re-saves to the same
    bytes (the Transformers version aside) and holds none of the new keys."""
    config = DFlashConfig.from_pretrained(DFLASH_V5)
    assert not config.is_dflash2
    config.save_pretrained(tmp_path)
    original = json.loads((DFLASH_V5 / "config.json").read_text())
    resaved = (tmp_path / "config.json").read_text()
    version = json.loads(resaved)["transformers_version"]
    expected = (DFLASH_V5 / "config.json").read_text().replace(original["transformers_version"], version)
    assert resaved == expected
    new_keys = {*V2_FIELDS, "input_embedding_scale", "output_multiplier", "final_logit_softcapping"}
    assert not new_keys & set(json.loads(resaved))


def test_a_dflash2_config_round_trips_its_fields(tmp_path):
    config = DFlashConfig(**V1, **V2_FIELDS, output_multiplier=0.25, final_logit_softcapping=20.0)
    assert config.is_dflash2
    config.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert {key: written[key] for key in V2_FIELDS} == V2_FIELDS
    assert written["output_multiplier"] == 0.25 and written["final_logit_softcapping"] == 20.0
    assert "input_embedding_scale" not in written  # at its no-op value
    loaded = DFlashConfig.from_pretrained(tmp_path)
    assert {key: getattr(loaded, key) for key in V2_FIELDS} == V2_FIELDS and loaded.output_multiplier == 0.25


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            dict(conv_kernel_size=2),
            r"conv_kernel_size is set but \['conv_group_size', 'selector_rank', 'selector_top_k'\]",
        ),
        (dict(V2_FIELDS, selector_rank=None), r"but \['selector_rank'\] are not"),
        (dict(V2_FIELDS, conv_group_size=5), r"conv_group_size=5 must divide hidden_size=32"),
        (dict(V2_FIELDS, conv_kernel_size=5), r"conv_kernel_size=5 must be <= block_size=4"),
        (dict(V2_FIELDS, selector_top_k=129), r"selector_top_k=129 must be <= vocab_size=128"),
        (dict(V2_FIELDS, selector_rank=2.0), r"selector_rank=2\.0 must be an integer"),
        (dict(V2_FIELDS, selector_rank=0), r"selector_rank=0 must be >= 1"),
        (dict(V2_FIELDS, draft_vocab_size=2), r"draft_vocab_size=2 < selector_top_k=3"),
        (dict(output_multiplier=0.0), r"output_multiplier=0\.0 must be > 0"),
        (dict(output_multiplier=float("nan")), r"output_multiplier=nan must be a finite number"),
        (dict(input_embedding_scale=-1.0), r"input_embedding_scale=-1\.0 must be > 0"),
        (dict(final_logit_softcapping=-20.0), r"final_logit_softcapping=-20\.0 must be > 0"),
    ],
    ids=[
        "one_of_four",
        "three_of_four",
        "groups",
        "taps",
        "top_k",
        "float_rank",
        "zero_rank",
        "draft_vocab",
        "multiplier",
        "nan_multiplier",
        "embedding_scale",
        "softcap",
    ],
)
def test_config_checks_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        DFlashConfig(**(V1 | overrides))


# ---------------------------------------------------------------- the convolution


def naive_conv(hidden, deltas, base_kernel, block_size):
    """out[b, t, c] = sum_j [t % block_size >= j] (base[j, c] + deltas[b, t, j, c // group]) * hidden[b, t - j, c],
    one position and tap at a time."""
    batch, length, size = hidden.shape
    taps, groups = deltas.shape[-2:]
    channel_group = torch.arange(size) // (size // groups)
    out = torch.zeros_like(hidden)
    for t in range(length):
        for j in range(taps):
            if t % block_size >= j:
                out[:, t] += (base_kernel[j] + deltas[:, t, j][:, channel_group]) * hidden[:, t - j]
    return out


def test_conv_by_hand_stops_at_the_block_boundary():
    """H=2 (one group), 2 taps, blocks of 2 over 3 positions: t0 and t2 start blocks and read no earlier token."""
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]])
    base = torch.tensor([[1.0, 10.0], [100.0, 1000.0]])
    deltas = torch.tensor([[[0.0, 0.0], [1.0, 2.0], [0.0, 5.0]]]).unsqueeze(-1)  # (1, 3, taps=2, groups=1)
    out = grouped_dynamic_conv(hidden, deltas, base, block_size=2)
    # t0: base0 * h0; t1: (base0 + 1) * h1 + (base1 + 2) * h0 = [2*3 + 102*1, 11*4 + 1002*2]; t2: base0 * h2
    assert torch.equal(out, torch.tensor([[[1.0, 20.0], [108.0, 2048.0], [5.0, 60.0]]]))


def test_conv_deltas_apply_per_group_of_channels():
    hidden = torch.ones(1, 2, 4)
    base = torch.zeros(2, 4)
    deltas = torch.zeros(1, 2, 2, 2)
    deltas[0, 1, 1, 0] = 3.0  # position 1, tap 1, group 0 (channels 0 and 1)
    out = grouped_dynamic_conv(hidden, deltas, base, block_size=4)
    assert torch.equal(out, torch.tensor([[[0.0, 0.0, 0.0, 0.0], [3.0, 3.0, 0.0, 0.0]]]))


def test_conv_equals_the_naive_sum_on_random_values():
    generator = torch.Generator().manual_seed(0)
    hidden, base = torch.randn(2, 7, 12, generator=generator), torch.randn(3, 12, generator=generator)
    deltas = torch.randn(2, 7, 3, 4, generator=generator)
    torch.testing.assert_close(grouped_dynamic_conv(hidden, deltas, base, 3), naive_conv(hidden, deltas, base, 3))


def test_a_layer_convolves_the_block_around_both_sublayers_and_never_the_context():
    """The layer equals its definition built from the attention and MLP (black boxes), the naive convolution
    and the deltas read from each sublayer's normed input; the context reaches the attention unconvolved."""
    model = perturbed(DFlashDraftModel(DFlashConfig(**V1, **V2_FIELDS)))
    layer, inputs = model.layers[0], block_inputs(batch=2)
    block, context = inputs["noise_embeds"], model.fuse_context(inputs["context_hidden_states"])
    position_embeddings = model.rotary_emb(block, torch.arange(5 + 4)[None])

    def around(conv, sublayer, normed):
        deltas = conv.kernel_projection(normed).view(2, 4, 2, 2, 4)  # (B, q, sides, taps, groups)
        inner = sublayer(naive_conv(normed, deltas[:, :, 0], conv.base_kernel[0], 4))
        return naive_conv(inner, deltas[:, :, 1], conv.base_kernel[1], 4)

    with torch.no_grad():
        attention = lambda normed: layer.self_attn(normed, context, position_embeddings)  # noqa: E731
        middle = block + around(layer.attention_conv, attention, layer.input_layernorm(block))
        expected = middle + around(layer.mlp_conv, layer.mlp, layer.post_attention_layernorm(middle))
        actual = layer(block, context, position_embeddings)
    torch.testing.assert_close(actual, expected)


# ---------------------------------------------------------------- identity initialisation


def test_a_new_dflash2_drafter_starts_at_identity():
    model = DFlashDraftModel(DFlashConfig(**V1, **V2_FIELDS))
    for layer in model.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            expected = torch.zeros(2, 2, 32)
            expected[:, 0] = 1.0
            assert torch.equal(conv.base_kernel, expected)
            assert not conv.kernel_projection.weight.any()
    selector = model.candidate_selector
    assert not selector.hidden_projection.weight.any()
    assert selector.predecessor_codebook.std() > 0.01 and selector.successor_codebook.std() > 0.01  # trainable


def test_dflash2_from_dflash_computes_the_same_hidden_states():
    v1 = perturbed(DFlashDraftModel(DFlashConfig(**V1)))
    v2 = dflash2_from_dflash(v1, conv_group_size=8, selector_rank=6, selector_top_k=3)
    assert v2.config.is_dflash2 and not v1.config.is_dflash2
    inputs = block_inputs(batch=2) | {"attention_mask": torch.tensor([[0, 1, 1, 1, 1] + [1] * 4, [1] * 9])}
    assert torch.equal(outputs(v2, inputs), outputs(v1, inputs))
    assert not torch.equal(outputs(perturbed(v2, seed=5, only_dflash2=True), inputs), outputs(v1, inputs))
    with pytest.raises(ValueError, match="already DFlash2"):
        dflash2_from_dflash(v2)


def test_identity_selector_walks_the_dflash_greedy_chain():
    v1 = perturbed(DFlashDraftModel(DFlashConfig(**V1)))
    v2 = dflash2_from_dflash(v1, conv_group_size=8, selector_rank=6, selector_top_k=3)
    lm_head = nn.Linear(32, 128, bias=False)
    hidden = outputs(v2, block_inputs(batch=3))[:, 1:]
    chain = selector_chain(v2, hidden, lm_head, anchor_ids=torch.tensor([5, 9, 127]))
    assert torch.equal(chain.tokens, v1.greedy_draft_tokens(outputs(v1, block_inputs(batch=3))[:, 1:], lm_head))
    perturbed(v2, seed=3, only_dflash2=True)  # a trained selector may choose otherwise: the walk reads it
    with torch.no_grad():
        v2.candidate_selector.hidden_projection.weight.mul_(1000.0)
    assert not torch.equal(selector_chain(v2, hidden, lm_head, torch.tensor([5, 9, 127])).tokens, chain.tokens)


def test_dflash2_training_forward_equals_the_served_forward_per_block():
    """Oracle 1 for DFlash2: packed blocks (the convolution must not cross block boundaries) == one block
    at a time with its own context, in fp32."""
    from hf_dflash.trainer import DFlashDataCollator, compute_target_features
    from hf_dflash.trainer.forward import dflash_training_forward
    from tests.conftest import make_drafter, make_target
    from tests.helpers.training import BLOCK, samples

    target = make_target("qwen3")
    drafter = perturbed(make_drafter(target, block_size=BLOCK, **V2_FIELDS), only_dflash2=True)
    batch = DFlashDataCollator(BLOCK, num_anchors=5, mask_token_id=drafter.config.mask_token_id, gamma=3.0)(
        samples(count=2)
    )
    features = compute_target_features(
        target, batch["input_ids"], drafter.config.target_layer_ids, batch["attention_mask"]
    )
    embedding = target.get_input_embeddings()
    with torch.no_grad():
        packed = dflash_training_forward(drafter, embedding, batch, features, drafter.config)
        for row, anchor in batch["anchor_valid"].nonzero().tolist():
            p = int(batch["anchor_positions"][row, anchor])
            block = slice(anchor * BLOCK, (anchor + 1) * BLOCK)
            served = drafter(
                noise_embeds=embedding(batch["block_ids"][row : row + 1, block]),
                context_hidden_states=features[row : row + 1, :p],
                position_ids=torch.arange(p + BLOCK)[None],
            ).last_hidden_state
            assert (served - packed[row : row + 1, block]).abs().max() < 1e-5


# ---------------------------------------------------------------- the transforms


def test_input_embedding_scale_multiplies_the_block_embeddings():
    v1 = perturbed(DFlashDraftModel(DFlashConfig(**V1)))
    scaled = DFlashDraftModel(DFlashConfig(**V1, input_embedding_scale=3.0)).eval()
    scaled.load_state_dict(v1.state_dict())
    inputs = block_inputs()
    tripled = inputs | {"noise_embeds": inputs["noise_embeds"] * 3.0}
    torch.testing.assert_close(outputs(scaled, inputs), outputs(v1, tripled))


def test_draft_logits_apply_the_multiplier_then_the_softcap():
    model = DFlashDraftModel(DFlashConfig(**V1, output_multiplier=0.5, final_logit_softcapping=2.0))
    lm_head = nn.Linear(32, 128, bias=False)
    with torch.no_grad():
        lm_head.weight.zero_()
        lm_head.weight[0, 0], lm_head.weight[1, 0] = 4.0, -100.0
        logits = model.draft_logits(torch.eye(32)[:1], lm_head)
    expected_first = 2.0 * torch.tanh(torch.tensor([2.0, -50.0]) / 2.0)  # raw 4, -100 -> x 0.5 -> 2 tanh(x / 2)
    torch.testing.assert_close(logits[0, :2], expected_first)
    assert not logits[0, 2:].any()


# ---------------------------------------------------------------- the official folder

OFFICIAL_CONFIG = {  # z-lab's tests/fixtures/dflash2-config.json, at tiny sizes
    "architectures": ["DFlash2DraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "is_causal": False,
    "dflash_config": {
        "block_size": 4,
        "conv_group_size": 8,
        "conv_kernel_size": 2,
        "final_logit_softcapping": 20.0,
        "mask_token_id": 127,
        "output_multiplier": 0.25,
        "selector_rank": 6,
        "selector_top_k": 3,
        "target_layer_ids": [1, 3],
    },
    "dtype": "bfloat16",
    "eos_token_id": 2,
    "head_dim": 8,
    "hidden_act": "silu",
    "hidden_size": 32,
    "initializer_range": 0.02,
    "intermediate_size": 64,
    "layer_types": ["sliding_attention", "sliding_attention"],
    "max_position_embeddings": 256,
    "max_window_layers": 2,
    "model_type": "qwen3",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "num_target_layers": 6,
    "pad_token_id": 0,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
    "sliding_window": 64,
    "tie_word_embeddings": False,
    "transformers_version": "5.15.0",
    "use_cache": False,
    "use_sliding_window": True,
    "vocab_size": 128,
}
# Fields of z-lab's config that a drafter does not use; written back without them.
NOT_WRITTEN_BACK = {"bos_token_id", "eos_token_id", "pad_token_id", "max_window_layers", "use_cache"}


def official_shapes() -> dict[str, tuple]:
    """Tensor names and shapes of z-lab's tests/fixtures/dflash2-safetensors-header.json for hidden 32, 4 x 8
    query and 2 x 8 key/value heads, intermediate 64, 2 features, 2 taps over 4 groups of 8, rank 6, vocab 128."""
    shapes = {
        "candidate_selector.hidden_projection.weight": (6, 32),
        "candidate_selector.predecessor_codebook": (128, 6),  # bare: no ".weight"
        "candidate_selector.successor_codebook": (128, 6),
        "fc.weight": (32, 2 * 32),
        "hidden_norm.weight": (32,),
        "norm.weight": (32,),
    }
    for i in range(2):
        shapes |= {
            f"layers.{i}.attention_conv.base_kernel": (2, 2, 32),  # (before/after, taps, hidden)
            f"layers.{i}.attention_conv.kernel_projection.weight": (2 * 2 * 4, 32),  # (sides x taps x groups, hidden)
            f"layers.{i}.input_layernorm.weight": (32,),
            f"layers.{i}.mlp.down_proj.weight": (32, 64),
            f"layers.{i}.mlp.gate_proj.weight": (64, 32),
            f"layers.{i}.mlp.up_proj.weight": (64, 32),
            f"layers.{i}.mlp_conv.base_kernel": (2, 2, 32),
            f"layers.{i}.mlp_conv.kernel_projection.weight": (16, 32),
            f"layers.{i}.post_attention_layernorm.weight": (32,),
            f"layers.{i}.self_attn.k_norm.weight": (8,),
            f"layers.{i}.self_attn.k_proj.weight": (16, 32),
            f"layers.{i}.self_attn.o_proj.weight": (32, 32),
            f"layers.{i}.self_attn.q_norm.weight": (8,),
            f"layers.{i}.self_attn.q_proj.weight": (32, 32),
            f"layers.{i}.self_attn.v_proj.weight": (16, 32),
        }
    return shapes


def write_official_folder(folder: Path, seed: int = 0) -> Path:
    generator = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True)
    tensors = {}
    for name, shape in official_shapes().items():
        value = 0.1 * torch.randn(shape, generator=generator)
        if name.endswith("norm.weight") or name.endswith("base_kernel"):
            value = value + 1.0
        tensors[name] = value.to(torch.bfloat16)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(OFFICIAL_CONFIG, indent=2))
    return folder


def header(file: Path) -> dict:
    with safe_open(str(file), framework="pt") as handle:
        return {
            key: (handle.get_slice(key).get_dtype(), tuple(handle.get_slice(key).get_shape())) for key in handle.keys()
        }


@pytest.fixture(scope="module")
def official_dir(tmp_path_factory):
    return write_official_folder(tmp_path_factory.mktemp("zlab") / "drafter")


@pytest.fixture(scope="module")
def official_model(official_dir):
    return load_drafter(official_dir)


def test_the_official_folder_loads_with_its_exact_names(official_dir, official_model):
    config = official_model.config
    assert isinstance(official_model, DFlashDraftModel) and config.is_dflash2
    assert [getattr(config, name) for name in V2_FIELDS] == [2, 8, 6, 3]
    assert (config.output_multiplier, config.final_logit_softcapping) == (0.25, 20.0)
    assert config.sliding_window_non_causal is True  # z-lab's is_causal: false
    stored = load_file(str(official_dir / "model.safetensors"))
    state = official_model.state_dict()
    assert {key: tuple(value.shape) for key, value in state.items()} == official_shapes()
    assert all(torch.equal(state[key], stored[key]) for key in stored)
    assert official_model.dtype == torch.bfloat16


def test_the_official_folder_is_written_back_unchanged(official_dir, official_model, tmp_path):
    written = save_official(official_model, tmp_path / "official")
    assert (written / "model.safetensors").read_bytes() == (official_dir / "model.safetensors").read_bytes()
    assert header(written / "model.safetensors") == header(official_dir / "model.safetensors")
    config = json.loads((written / "config.json").read_text())
    assert config["dflash_config"] == OFFICIAL_CONFIG["dflash_config"]
    kept = set(OFFICIAL_CONFIG) - NOT_WRITTEN_BACK - {"transformers_version"}
    assert {key: config.get(key) for key in kept} == {key: OFFICIAL_CONFIG[key] for key in kept}
    assert not NOT_WRITTEN_BACK & set(config)


def test_convert_both_ways_keeps_the_drafter(official_dir, official_model, tmp_path):
    inputs = {key: value.to(torch.bfloat16) for key, value in block_inputs().items()}
    expected = outputs(official_model, inputs)
    hub = convert(official_dir, tmp_path / "hub", to="hub")
    hub_config = json.loads((hub / "config.json").read_text())
    assert {key: hub_config[key] for key in V2_FIELDS} == V2_FIELDS and hub_config["model_type"] == "dflash"
    assert torch.equal(outputs(load_drafter(hub), inputs), expected)
    back = convert(hub, tmp_path / "official", to="official")
    assert (back / "model.safetensors").read_bytes() == (official_dir / "model.safetensors").read_bytes()
    assert json.loads((back / "config.json").read_text())["dflash_config"] == OFFICIAL_CONFIG["dflash_config"]


def write_speculators_folder(model: DFlashDraftModel, folder: Path, **overrides) -> Path:
    """`model` in vLLM speculators' DFlash2 layout (speculators/models/dflash2/config.py): the DFlash layout
    with `speculators_model_type: "dflash2"` and the four fields top-level, the verifier's copies beside."""
    folder.mkdir(parents=True)
    config = model.config
    decoder = {field: getattr(config, field) for field in ("vocab_size", "hidden_size", "intermediate_size",
               "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
               "max_position_embeddings")}  # fmt: skip
    decoder |= {"model_type": "qwen3", "hidden_act": "silu", "rope_parameters": dict(config.rope_parameters)}
    layout = {
        "speculators_model_type": "dflash2",
        "architectures": ["DFlash2DraftModel"],
        "block_size": config.block_size,
        "draft_vocab_size": config.vocab_size,
        "mask_token_id": config.mask_token_id,
        "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
        "projector_type": "dflash",
        "sample_from_anchor": False,
        "transformer_layer_config": decoder,
        **{field: getattr(config, field) for field in V2_FIELDS},
        **overrides,
    }
    (folder / "config.json").write_text(json.dumps(layout))
    weights = {key: value.clone() for key, value in model.state_dict().items()}
    weights |= {"embed_tokens.weight": torch.randn(128, 32), "t2d": torch.ones(128, dtype=torch.bool)}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_a_speculators_dflash2_folder_loads_and_converts(tmp_path):
    source = perturbed(DFlashDraftModel(DFlashConfig(**V1, **V2_FIELDS)), seed=3)
    folder = write_speculators_folder(source, tmp_path / "speculators")
    loaded = load_drafter(folder, num_target_layers=6)
    assert loaded.config.is_dflash2 and [getattr(loaded.config, f) for f in V2_FIELDS] == [2, 8, 6, 3]
    assert loaded.config.sliding_window_non_causal is True  # speculators' DFlash2 default
    inputs = block_inputs()
    assert torch.equal(outputs(loaded, inputs), outputs(source, inputs))
    hidden, head, anchor = torch.randn(1, 3, 32), nn.Linear(32, 128).requires_grad_(False), torch.tensor([5])
    walk = selector_chain(loaded, hidden, head, anchor)  # the selector's weights arrived too
    expected = selector_chain(source, hidden, head, anchor)
    assert torch.equal(walk.tokens, expected.tokens) and torch.equal(walk.scores, expected.scores)
    official = convert(folder, tmp_path / "official", to="official", num_target_layers=6)
    assert torch.equal(outputs(load_drafter(official), inputs), outputs(source, inputs))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"selector_rank": None}, r"'dflash2' config that lacks \['selector_rank'\]"),
        ({"speculators_model_type": "dflash"}, r"'dflash' config that has the DFlash2 fields \['conv_group_size'"),
        ({"speculators_model_type": "dspark"}, r"'dspark' checkpoint"),
    ],
    ids=["missing_field", "fields_on_dflash", "dspark"],
)
def test_speculators_dflash2_configs_that_cannot_be_read_are_named(tmp_path, overrides, message):
    source = DFlashDraftModel(DFlashConfig(**V1, **V2_FIELDS))
    folder = write_speculators_folder(source, tmp_path / "speculators", **overrides)
    with pytest.raises(ValueError, match=message):
        load_drafter(folder, num_target_layers=6)


def _edit(folder: Path, config_edit=None, weights_edit=None) -> Path:
    if config_edit is not None:
        config = json.loads((folder / "config.json").read_text())
        config_edit(config)
        (folder / "config.json").write_text(json.dumps(config))
    if weights_edit is not None:
        tensors = load_file(str(folder / "model.safetensors"))
        save_file(weights_edit(tensors), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _rename(old: str, new: str):
    return lambda tensors: {new if key == old else key: value for key, value in tensors.items()}


@pytest.mark.parametrize(
    "config_edit, weights_edit, message",
    [
        (lambda c: c["dflash_config"].pop("selector_top_k"), None, r"lacks \['selector_top_k'\]"),
        (
            lambda c: c["dflash_config"].update(conv_dilation=2),
            None,
            r"dflash_config\.conv_dilation is not a DFlash2 field",
        ),
        (lambda c: c.update(architectures=["DFlashDraftModel"]), None, r"architectures=\['DFlashDraftModel'\]"),
        (
            lambda c: c.update(selector_rank=c["dflash_config"].pop("selector_rank")),
            None,
            r"\['selector_rank'\] are top-level",
        ),
        (lambda c: c["dflash_config"].update(conv_group_size=7), None, r"conv_group_size=7 must divide hidden_size=32"),
        (lambda c: c["dflash_config"].pop("mask_token_id"), None, r"dflash_config\.mask_token_id is missing"),
        (
            None,
            _rename("candidate_selector.successor_codebook", "candidate_selector.successor_codebook.weight"),
            r"unexpected keys \['candidate_selector\.successor_codebook\.weight'\]",
        ),
        (
            None,
            lambda t: {k: v for k, v in t.items() if k != "layers.1.mlp_conv.base_kernel"},
            r"missing keys \['layers\.1\.mlp_conv\.base_kernel'\]",
        ),
        (
            lambda c: c["dflash_config"].update(conv_kernel_size=3),
            None,
            r"layers\.0\.attention_conv\.base_kernel is \(2, 2, 32\) .* \(2, 3, 32\) \(2 \(before, after\), "
            r"conv_kernel_size=3",
        ),
        (
            lambda c: c["dflash_config"].update(selector_rank=5),
            None,
            r"candidate_selector\.hidden_projection\.weight is \(6, 32\) .* \(5, 32\) \(selector_rank=5",
        ),
    ],
    ids=[
        "missing_field",
        "unknown_field",
        "v1_architecture",
        "top_level_field",
        "bad_groups",
        "no_mask",
        "codebook_with_weight_suffix",
        "missing_tensor",
        "taps_mismatch",
        "rank_mismatch",
    ],
)
def test_official_folder_checks_name_the_problem(official_dir, tmp_path, config_edit, weights_edit, message):
    import shutil

    folder = _edit(Path(shutil.copytree(official_dir, tmp_path / "copy")), config_edit, weights_edit)
    with pytest.raises(ValueError, match=message):
        load_drafter(folder)


def test_a_zlab_model_object_is_translated(official_dir, official_model):
    """z-lab's DFlash2DraftModel keeps the codebooks as embeddings (`...codebook.weight`): drafter_from_model
    maps them to the bare names."""
    from transformers import Qwen3Config

    class ZLabLike(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = Qwen3Config(**{k: v for k, v in OFFICIAL_CONFIG.items() if k != "model_type"})
            self.held = nn.ParameterDict(
                {
                    key.replace(".", "/"): nn.Parameter(value)
                    for key, value in load_file(str(official_dir / "model.safetensors")).items()
                }
            )

        def state_dict(self, *args, **kwargs):
            named = {key.replace("/", "."): value for key, value in self.held.items()}
            return {key + (".weight" if key.endswith("_codebook") else ""): value for key, value in named.items()}

    foreign = ZLabLike()
    assert "candidate_selector.successor_codebook.weight" in foreign.state_dict()
    translated = drafter_from_model(foreign)
    assert translated.config.is_dflash2
    assert all(torch.equal(value, official_model.state_dict()[key]) for key, value in translated.state_dict().items())


# ---------------------------------------------------------------- remote code (no hf_dflash)

REMOTE_SCRIPT = """
import sys
sys.modules["hf_dflash"] = None
import torch
from transformers import AutoModel

model = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
assert not type(model).__module__.startswith("hf_dflash"), type(model).__module__
assert model.config.is_dflash2 and model.candidate_selector is not None, model.config
data = torch.load("expected.pt")
with torch.no_grad():
    out = model(**data["inputs"]).last_hidden_state
assert torch.equal(out, data["expected"]), (out - data["expected"]).abs().max()
print("REMOTE_OK")
"""


def test_remote_code_loads_both_dflash2_layouts(official_dir, official_model, tmp_path):
    inputs = {key: value.to(torch.bfloat16) for key, value in block_inputs().items()}
    torch.save({"inputs": inputs, "expected": outputs(official_model, inputs)}, tmp_path / "expected.pt")
    folders = {
        "hub": save_hub(official_model, tmp_path / "hub"),
        "official": save_official(official_model, tmp_path / "official"),
    }
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    processes = {
        name: subprocess.Popen(
            [sys.executable, "-c", REMOTE_SCRIPT, str(folder)],
            cwd=tmp_path,
            env={**env, "HF_MODULES_CACHE": str(tmp_path / f"modules_{name}")},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, folder in folders.items()
    }
    for name, process in processes.items():
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0 and "REMOTE_OK" in stdout, f"{name}: {stdout}{stderr}"


# ---------------------------------------------------------------- the selector walk

# Hand-made selector: 6 tokens, rank 2. Slot scores S[k] = unary[k] + <A[pred] * P[slot], B[candidate k]>.
A = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0], [2.0, 0.0], [0.0, 2.0]])
B = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [3.0, 0.0], [0.0, 3.0], [1.0, 1.0]])
P = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
CANDIDATES = torch.tensor([[1, 2], [3, 4]])
UNARY = torch.tensor([[1.0, 0.5], [0.0, 0.2]])


def test_the_walk_by_hand():
    """Anchor 0: slot 1 A[0]*P[0] = [1, 0]: token 1 -> 1.0 + 1 = 2.0, token 2 -> 0.5 + 0 = 0.5: picks 1;
    slot 2 (pred 1) A[1]*P[1] = [0, -1]: token 3 -> 0.0, token 4 -> 0.2 - 3 = -2.8: picks 3 (unary prefers 4).
    Anchor 1: slot 1 A[1]*P[0] = [0, 1]: 1.0 vs 0.5 + 1 = 1.5: picks 2; slot 2 (pred 2, the token chosen, not
    the unary best 1) A[2]*P[1] = [1, -1]: 0 + 3 = 3.0 vs 0.2 - 3 = -2.8: picks 3."""
    batch = selector_walk(
        CANDIDATES.expand(2, 2, 2), UNARY.expand(2, 2, 2), P.expand(2, 2, 2), A, B, torch.tensor([0, 1])
    )
    assert batch.tokens.tolist() == [[1, 3], [2, 3]]
    assert batch.choices.tolist() == [[0, 0], [1, 0]]
    torch.testing.assert_close(batch.scores, torch.tensor([[[2.0, 0.5], [0.0, -2.8]], [[1.0, 1.5], [3.0, -2.8]]]))
    single = selector_walk(CANDIDATES, UNARY, P, A, B, torch.tensor(1))  # no batch dimension
    assert single.tokens.tolist() == [2, 3]


def test_with_a_zero_projection_the_walk_takes_each_slots_best_unary_candidate():
    candidates = torch.tensor([[5, 1, 3], [2, 0, 4]])
    unary = torch.tensor([[0.1, 0.9, 0.3], [2.0, -1.0, 2.5]])
    walk = selector_walk(candidates, unary, torch.zeros(2, 2), A, B, torch.tensor(0))
    assert walk.tokens.tolist() == [1, 4]
    assert torch.equal(walk.scores, unary)


def test_unary_top_k_is_best_first_and_breaks_ties_by_id():
    logits = torch.tensor([[0.5, 2.0, 1.0, 2.0, -1.0, 1.0]])
    ids, values = unary_top_k(logits, 4)
    assert ids.tolist() == [[1, 3, 2, 5]] and values.tolist() == [[2.0, 2.0, 1.0, 1.0]]
    assert ids[0, 0] == logits.argmax(-1)[0]


def test_selector_chain_needs_a_dflash2_drafter():
    with pytest.raises(ValueError, match="needs a DFlash2 drafter"):
        selector_chain(
            DFlashDraftModel(DFlashConfig(**V1)), torch.zeros(1, 3, 32), nn.Linear(32, 128), torch.tensor([0])
        )
