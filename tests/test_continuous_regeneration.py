"""Continuous-batching greedy regeneration: every reply equals the prompt's own greedy reply."""

import pytest
import torch
from transformers.cache_utils import DynamicCache

from hf_dflash.caches import compact_cache, merge_caches
from hf_dflash.data.continuous import continuous_greedy_replies

from .conftest import make_target

PROMPTS = [[5 + i, 7, 9 + 2 * i] + [11 + (i * j) % 90 for j in range(i % 5 * 3)] for i in range(9)]


def plain_greedy(model, prompt, max_new_tokens, eos_ids):
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_ids,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    end = next((i + 1 for i, t in enumerate(out) if t in eos_ids), len(out))
    return out[:end]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("batch_size,refill_below", [(1, 1), (3, 2), (4, None), (16, None)])
def test_continuous_replies_equal_plain_greedy_per_prompt(arch, batch_size, refill_below):
    model = make_target(arch)
    # An EOS that the greedy replies do produce, so rows finish at different steps and others join.
    first = plain_greedy(model, PROMPTS[0], 12, eos_ids=[-1])
    eos_ids = [first[4], first[9]]
    expected = [plain_greedy(model, prompt, 12, eos_ids) for prompt in PROMPTS]
    assert len({len(reply) for reply in expected}) > 1  # the rows really do end at different times
    done = []
    replies = continuous_greedy_replies(
        model,
        PROMPTS,
        eos_ids=eos_ids,
        pad_id=0,
        max_new_tokens=12,
        batch_size=batch_size,
        refill_below=refill_below,
        on_reply=done.append,
    )
    assert replies == expected
    assert len(done) == len(PROMPTS)


def test_merge_caches_left_pads_the_shorter_and_keeps_every_row():
    def cache_of(batch, width, value):
        cache = DynamicCache()
        cache.update(torch.full((batch, 2, width, 4), value), torch.full((batch, 2, width, 4), -value), 0)
        return cache

    a, b = cache_of(2, 3, 1.0), cache_of(1, 5, 2.0)
    mask = merge_caches(a, torch.ones(2, 3, dtype=torch.long), b, torch.ones(1, 5, dtype=torch.long))
    assert mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    keys = a.layers[0].keys
    assert keys.shape == (3, 2, 5, 4)
    assert (keys[:2, :, :2] == 0).all() and (keys[:2, :, 2:] == 1).all() and (keys[2] == 2).all()
    assert (a.layers[0].values[2] == -2).all()
    compacted = compact_cache(a, mask)  # the padding slots are what compaction later removes
    assert compacted.shape == (3, 5)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="batch_size"):
        continuous_greedy_replies(make_target(), PROMPTS, eos_ids=[2], pad_id=0, max_new_tokens=4, batch_size=0)


def test_reserved_layer_behaves_like_a_dynamic_layer_without_a_copy_per_step():
    from transformers.cache_utils import DynamicLayer

    from hf_dflash.caches import ReservedLayer

    torch.manual_seed(0)
    reserved, dynamic = ReservedLayer(reserve=4), DynamicLayer()
    prefill = torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 4)
    for layer in (reserved, dynamic):
        layer.update(*prefill)
    buffer = reserved.keys.untyped_storage().data_ptr()
    grown = 0
    for step in range(10):
        new = torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4)
        keys, values = reserved.update(*new)
        expected_keys, expected_values = dynamic.update(*new)
        assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)
        assert reserved.get_seq_length() == dynamic.get_seq_length() == 6 + step
        if reserved.keys.untyped_storage().data_ptr() != buffer:
            grown, buffer = grown + 1, reserved.keys.untyped_storage().data_ptr()
    assert grown == 2  # 10 new slots, room for 4 at a time: 2 regrowths, not 10 copies
    for layer in (reserved, dynamic):
        layer.batch_select_indices(torch.tensor([2, 0]))
    assert torch.equal(reserved.keys, dynamic.keys) and torch.equal(reserved.values, dynamic.values)
    new = torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4)
    assert all(torch.equal(a, b) for a, b in zip(reserved.update(*new), dynamic.update(*new)))
    reserved.reset()
    assert reserved.get_seq_length() == 0 and not reserved.is_initialized
    reserved.update(*prefill)
    assert torch.equal(reserved.keys, prefill[0])
    with pytest.raises(ValueError, match="reserve"):
        ReservedLayer(reserve=0)


def test_the_regeneration_cache_reserves_slots():
    from hf_dflash.caches import ReservedLayer
    from hf_dflash.data.continuous import prefill

    cache, mask, first = prefill(make_target("qwen3"), PROMPTS[:3], pad_id=0)
    assert all(isinstance(layer, ReservedLayer) for layer in cache.layers)
    assert mask.shape[0] == first.shape[0] == 3
