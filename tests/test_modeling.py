"""The drafter: exact weight names, KV injection, bidirectional block, cache consistency, config checks."""

import pytest
import torch
from transformers.cache_utils import DFlashCache

from hf_dflash import DFlashConfig, DFlashDraftModel
from hf_dflash.modeling_dflash import choose_mask_token_id, default_target_layer_ids
from hf_dflash.modeling_dflash.modeling_dflash import dflash_attention_mask


def tiny_config(**overrides) -> DFlashConfig:
    fields = dict(
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
    )
    return DFlashConfig(**(fields | overrides))


def tiny_drafter(**overrides) -> DFlashDraftModel:
    torch.manual_seed(0)
    return DFlashDraftModel(tiny_config(**overrides)).eval()


def test_state_dict_keys_are_the_official_ones():
    keys = set(tiny_drafter().state_dict())
    per_layer = [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    ]
    expected = {f"layers.{i}.{name}" for i in range(2) for name in per_layer}
    assert keys == expected | {"norm.weight", "fc.weight", "hidden_norm.weight"}
    assert tiny_drafter().fc.weight.shape == (32, 2 * 32)  # len(target_layer_ids) * target_hidden_size -> hidden


def test_the_drafter_has_no_embedding_and_no_lm_head_of_its_own():
    """Both are the target's: asked for them (accelerate's FSDP2 wrapping asks both), the drafter answers None
    instead of Transformers' NotImplementedError, so nothing of the target is sharded or trained with it."""
    drafter = tiny_drafter()
    assert drafter.get_input_embeddings() is None
    assert drafter.get_output_embeddings() is None


@pytest.mark.parametrize(
    "layers, features, expected",
    [(36, 5, [1, 9, 17, 25, 33]), (30, 5, [1, 8, 14, 20, 27]), (24, 5, [1, 6, 11, 16, 21]), (30, 1, [15])],
)
def test_default_target_layer_ids(layers, features, expected):
    assert default_target_layer_ids(layers, features) == expected


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(mask_token_id=None), "mask_token_id is missing"),
        (dict(mask_token_id=128), "mask_token_id=128 is outside"),
        (dict(target_layer_ids=[1, 6]), r"\[6\] outside \[0, num_target_layers=6\)"),
        (dict(target_layer_ids=[3, 3]), "duplicates"),
        (dict(target_layer_ids=[]), "empty"),
        (dict(block_size=1), "block_size must be an int >= 2"),
        (dict(num_key_value_heads=3), "not a multiple"),
        (dict(layer_types=["full_attention"]), "layer_types"),
        (dict(layer_types=["sliding_attention"] * 2), "sliding_window is not set"),
    ],
)
def test_config_validation_names_the_value(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(block_size=10**12), r"block_size=1000000000000 is larger than 1024, the largest block"),
        (dict(block_size=600, max_position_embeddings=512), r"block_size=600 is larger than max_position_embeddings"),
        (dict(num_attention_heads=0), r"num_attention_heads=0 must be an integer >= 1"),
        (dict(num_attention_heads=0, head_dim=None), r"num_attention_heads=0 must be an integer >= 1"),
        (dict(num_key_value_heads=0), r"num_key_value_heads=0 must be an integer >= 1"),
        (dict(head_dim=0), r"head_dim=0 must be an integer >= 1"),
        (dict(hidden_size=-3), r"hidden_size=-3 must be an integer >= 1"),
        (dict(hidden_size=True), r"hidden_size=True must be an integer >= 1"),
        (dict(intermediate_size=0), r"intermediate_size=0 must be"),
        (dict(num_hidden_layers=0), r"num_hidden_layers=0 must be"),
        (dict(num_attention_heads=4.0), r"num_attention_heads=4.0 must be an integer"),
        (dict(vocab_size=0), r"vocab_size=0 must be"),
        (dict(max_position_embeddings=0), r"max_position_embeddings=0 must be"),
        (dict(target_hidden_size=0), r"target_hidden_size=0 must be"),
        (dict(num_target_layers=0), r"num_target_layers=0 must be"),
        (dict(rms_norm_eps=float("nan")), r"rms_norm_eps=nan must be a finite number"),
        (dict(rms_norm_eps=float("inf")), r"rms_norm_eps=inf must be a finite number"),
        (dict(rms_norm_eps=0.0), r"rms_norm_eps=0.0 must be > 0"),
        (dict(rms_norm_eps=-1e-6), r"rms_norm_eps=-1e-06 must be > 0"),
        (
            dict(rope_parameters={"rope_type": "default", "rope_theta": float("nan")}),
            r"rope_theta=nan must be a finite",
        ),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": -1.0}), r"rope_theta=-1.0 must be > 0"),
        (dict(hidden_act="swishy"), r"hidden_act='swishy' is not an activation Transformers knows"),
        (dict(attention_dropout=2.0), r"attention_dropout=2.0 must be >= 0 and <= 1"),
        (dict(initializer_range=-1.0), r"initializer_range=-1.0 must be >= 0"),
        (dict(sliding_window=-1), r"sliding_window=-1 must be None or an integer >= 0"),
        (dict(attention_bias="no"), r"attention_bias must be true or false"),
    ],
)
def test_every_structural_field_is_range_checked(overrides, message):
    """Issue 36: a block of 10**12 was accepted (then allocated terabytes); a 0 head count died in a
    ZeroDivisionError (Transformers' or ours); an unknown activation in a KeyError inside Transformers; a NaN eps
    or RoPE base loaded and produced NaN drafts."""
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)
    assert tiny_config(block_size=256, max_position_embeddings=256).block_size == 256  # the bounds are inclusive


def test_from_target_config_derives_sizes(tiny_target):
    config = DFlashConfig.from_target_config(
        tiny_target.config, num_hidden_layers=3, block_size=8, num_target_features=2
    )
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (32, 4, 4)
    assert (config.head_dim, config.vocab_size, config.num_target_layers) == (8, 128, 6)
    assert config.target_layer_ids == [1, 3] and config.block_size == 8 and config.num_hidden_layers == 3
    assert config.rope_parameters["rope_theta"] == tiny_target.config.rope_parameters["rope_theta"]
    assert config.mask_token_id == 127  # no tokenizer: the last embedding row


class FakeTokenizer:
    """The attributes `choose_mask_token_id` reads, shaped like SmolLM2's and Qwen3's tokenizers."""

    def __init__(self, size, specials):
        self.size, self.specials = size, specials
        self.bos_token_id, self.eos_token_id, self.pad_token_id, self.unk_token_id = 1, 2, 2, 0
        self.chat_template = "<|im_start|>{{ m }}<|im_end|>"
        self.all_special_ids, self.added_tokens_decoder = list(specials), {}

    def __len__(self):
        return self.size

    def convert_ids_to_tokens(self, token_id):
        return self.specials[token_id]


def test_mask_token_choice():
    specials = {0: "<|endoftext|>", 1: "<|im_start|>", 2: "<|im_end|>", 3: "<repo_name>"}
    assert choose_mask_token_id(151936, FakeTokenizer(151669, specials)) == 151669  # first row past the tokenizer
    assert choose_mask_token_id(49152, FakeTokenizer(49152, specials)) == 3  # unused special, not in the template


def context_and_block(context_length=7, block=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, context_length, 64, generator=generator), torch.randn(1, block, 32, generator=generator)


def test_cached_context_rounds_equal_one_full_pass():
    """Round 1 caches context[:4]; round 2 adds context[4:]: same output as all context at once."""
    drafter = tiny_drafter()
    context, block = context_and_block()
    full = drafter(noise_embeds=block, context_hidden_states=context).last_hidden_state
    cache = DFlashCache(config=drafter.config)
    cache.set_previous_accepted_tokens(4)
    drafter(noise_embeds=block, context_hidden_states=context[:, :4], position_ids=torch.arange(8)[None], cache=cache)
    cache.crop(-4)  # the block of round 1 is never kept
    cache.set_previous_accepted_tokens(3)
    incremental = drafter(
        noise_embeds=block, context_hidden_states=context[:, 4:], position_ids=torch.arange(4, 11)[None], cache=cache
    ).last_hidden_state
    torch.testing.assert_close(incremental, full, rtol=1e-5, atol=1e-5)


def test_block_attention_is_bidirectional_and_sees_all_context():
    drafter = tiny_drafter()
    context, block = context_and_block()
    base = drafter(noise_embeds=block, context_hidden_states=context).last_hidden_state
    later_slot_changed = block.clone()
    later_slot_changed[:, 3] += 1.0
    out = drafter(noise_embeds=later_slot_changed, context_hidden_states=context).last_hidden_state
    assert not torch.allclose(out[:, 0], base[:, 0])  # slot 0 sees slot 3: not causal
    first_context_changed = context.clone()
    first_context_changed[:, 0] += 1.0
    out = drafter(noise_embeds=block, context_hidden_states=first_context_changed).last_hidden_state
    assert not torch.allclose(out, base)


def test_padding_mask_hides_context_tokens():
    drafter = tiny_drafter()
    context, block = context_and_block()
    mask = torch.ones(1, 11, dtype=torch.long)
    mask[:, :2] = 0
    masked = drafter(noise_embeds=block, context_hidden_states=context, attention_mask=mask).last_hidden_state
    context[:, :2] = 100.0
    again = drafter(noise_embeds=block, context_hidden_states=context, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(masked, again)


def test_eager_and_sdpa_agree():
    context, block = context_and_block()
    outputs = []
    for implementation in ("eager", "sdpa"):
        drafter = tiny_drafter()
        drafter.set_attn_implementation(implementation)
        mask = torch.ones(1, 11, dtype=torch.long)
        mask[:, 0] = 0
        outputs.append(
            drafter(noise_embeds=block, context_hidden_states=context, attention_mask=mask).last_hidden_state
        )
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)


def test_sliding_window_mask_is_causal_in_block_and_windowed_on_context():
    mask = dflash_attention_mask(None, query_length=3, key_length=8, sliding_window=4)[0, 0]
    expected = torch.tensor(
        [
            [0, 0, 1, 1, 1, 1, 0, 0],  # query at index 5 sees keys 2..5
            [0, 0, 0, 1, 1, 1, 1, 0],
            [0, 0, 0, 0, 1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)
    assert dflash_attention_mask(torch.ones(1, 8), 3, 8, None) is None  # nothing masked: SDPA runs unmasked


@pytest.mark.parametrize(
    "num_target_layers, target_layer_ids",
    [(6, [0, 2, 4]), (6, [5]), (3, [0, 2]), (2, [1])],
    ids=["six_layers", "one_feature", "shallow", "two_layers"],
)
def test_from_target_config_honours_explicit_target_layer_ids(tiny_target, num_target_layers, target_layer_ids):
    tiny_target.config.num_hidden_layers = num_target_layers
    config = DFlashConfig.from_target_config(tiny_target.config, target_layer_ids=target_layer_ids)
    assert config.target_layer_ids == target_layer_ids and config.num_target_layers == num_target_layers
    assert DFlashDraftModel(config).fc.in_features == len(target_layer_ids) * 32


def test_from_target_config_refuses_ids_that_contradict_the_feature_count(tiny_target):
    with pytest.raises(ValueError, match=r"num_target_features=3.*target_layer_ids=\[0, 2\]"):
        DFlashConfig.from_target_config(tiny_target.config, target_layer_ids=[0, 2], num_target_features=3)
    assert DFlashConfig.from_target_config(tiny_target.config, num_target_features=2).target_layer_ids == [1, 3]


def test_non_causal_sliding_window_mask_sees_the_whole_block_and_a_window_of_context():
    mask = dflash_attention_mask(None, query_length=3, key_length=8, sliding_window=4, block_causal=False)[0, 0]
    expected = torch.tensor(
        [
            [0, 0, 1, 1, 1, 1, 1, 1],  # query at index 5 sees context 2..4 and every block key (5..7)
            [0, 0, 0, 1, 1, 1, 1, 1],
            [0, 0, 0, 0, 1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("non_causal", [False, True])
def test_sliding_layer_semantics_is_a_config_field(non_causal):
    """sliding_window_non_causal=False (SpecForge, default): slot 0 cannot see later block slots;
    True (vLLM speculators' sliding_window_non_causal, z-lab's is_causal=false): it can."""
    drafter = tiny_drafter(
        layer_types=["sliding_attention", "sliding_attention"], sliding_window=16, sliding_window_non_causal=non_causal
    )
    assert drafter.config.sliding_window_non_causal is non_causal
    context, block = context_and_block()
    changed = block.clone()
    changed[:, 2] += 1.0
    with torch.no_grad():
        first = drafter(noise_embeds=block, context_hidden_states=context).last_hidden_state
        second = drafter(noise_embeds=changed, context_hidden_states=context).last_hidden_state
    assert torch.equal(first[:, :2], second[:, :2]) is not non_causal


def test_sliding_window_non_causal_must_be_a_bool():
    with pytest.raises(ValueError, match="sliding_window_non_causal"):
        tiny_config(sliding_window_non_causal="yes")
