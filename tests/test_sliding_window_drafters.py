"""Drafters with sliding-window layers (issue 53, item 1): the drafter's own cache rolls its block back once the
context passes the window, as the target's does (past recording), and a cached pass attends to exactly the keys a
cache-free forward over the whole context attends to. Layouts: z-lab's (every layer sliding, window 16,
bidirectional in the block), a DFlash2 drafter with sliding layers, one sliding layer of window 4 (causal or
bidirectional in the block). Greedy output equals plain greedy token for token (fp32) in every loop: the
package's, the folder's `custom_generate` and Transformers' assisted loop (`speculation_type="dflash"`), and in
batches, where a window counts tokens, not the cache slots that padding and rejected drafts leave empty. Training
masks each layer as serving does (window, causal or bidirectional block), so the function trained is the one served."""

import pytest
import torch

from hf_dflash.generation.drafting.block_drafter import BlockDrafter
from hf_dflash.modeling_dflash.custom_generate import dflash_decoding, drafter_cache, drafter_pass
from tests.conftest import make_drafter, make_target
from tests.helpers.generation import PAD, plain_greedy, prompt, random_batch
from tests.helpers.training import packed_equals_served, samples

SLIDING = "sliding_attention"
DFLASH2 = dict(conv_kernel_size=2, conv_group_size=8, selector_rank=6, selector_top_k=4)
# name: (block size, drafter config overrides)
LAYOUTS = {
    "zlab_all_sliding_16_bidirectional": (
        16,
        dict(layer_types=[SLIDING, SLIDING], sliding_window=16, sliding_window_non_causal=True),
    ),
    "dflash2_sliding_8": (4, dict(layer_types=[SLIDING, SLIDING], sliding_window=8, **DFLASH2)),
    "one_sliding_4_causal": (4, dict(layer_types=["full_attention", SLIDING], sliding_window=4)),
    "one_sliding_4_bidirectional": (
        4,
        dict(layer_types=[SLIDING, "full_attention"], sliding_window=4, sliding_window_non_causal=True),
    ),
}
PROMPT, NEW_TOKENS = 12, 30


def sliding_drafter(target, name: str):
    block_size, overrides = LAYOUTS[name]
    drafter = make_drafter(target, block_size=block_size, **overrides)
    if drafter.config.is_dflash2:  # move the convolutions and the selector off identity, so they take part
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for parameter_name, parameter in drafter.named_parameters():
                if "_conv." in parameter_name or parameter_name.startswith("candidate_selector."):
                    parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    return drafter


def run(loop: str, target, drafter, input_ids):
    kwargs = dict(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None)
    if loop == "package":
        return target.generate(input_ids, assistant_model=drafter, **kwargs)
    if loop == "transformers":  # Transformers' assisted loop (its DFlash cache records the past; the mask must follow)
        return target.generate(input_ids, assistant_model=drafter, speculation_type="dflash", **kwargs)
    return target.generate(input_ids, custom_generate=dflash_decoding, dflash_drafter=drafter, **kwargs)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("loop", ["package", "custom_generate", "transformers"])
def test_generation_past_the_drafter_window_matches_plain_greedy(loop, name):
    target = make_target("qwen3")
    drafter = sliding_drafter(target, name)
    input_ids = prompt(4, length=PROMPT)
    expected = plain_greedy(target, input_ids, max_new_tokens=NEW_TOKENS, eos_token_id=None)
    assert torch.equal(run(loop, target, drafter, input_ids), expected)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_cached_passes_equal_a_cache_free_forward_over_the_whole_context(name):
    """Rounds of `drafter_pass` on the drafter's cache (new context 11, 3, 1, 4, 2, 6 tokens: past every window)
    give the block outputs of one forward without cache over all the context so far (fp32, < 1e-5)."""
    target = make_target("qwen3")
    drafter = sliding_drafter(target, name)
    block_size = drafter.config.block_size
    embedding = target.get_input_embeddings()
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(1, 40, drafter.fc.in_features, generator=generator)
    bonus_tokens = torch.randint(3, 100, (10,), generator=generator)
    cache, seen = drafter_cache(drafter.config), 0
    with torch.no_grad():
        for round_index, new in enumerate([11, 3, 1, 4, 2, 6]):
            bonus = bonus_tokens[round_index : round_index + 1]
            positions = torch.arange(seen, seen + new + block_size)[None]
            cached = drafter_pass(
                drafter, embedding, cache, bonus, features[:, seen : seen + new], positions, block_size
            )
            seen += new
            block = torch.full((1, block_size), drafter.config.mask_token_id)
            block[:, 0] = bonus
            whole = drafter(noise_embeds=embedding(block), context_hidden_states=features[:, :seen]).last_hidden_state
            assert cache.get_seq_length() == seen
            assert (cached - whole[:, 1:]).abs().max() < 1e-5, (round_index, seen)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_batched_passes_with_holes_equal_each_rows_cache_free_forward(name):
    """Three rows drafted together over slots with holes (left padding, then rejected drafts: 30% of the 36 slots,
    a different pattern per row, one row dropped mid-way) give each row the block outputs of one forward without
    cache over that row's tokens alone (fp32, < 1e-5), past every window. Before, a batch's window counted slots
    (holes shortened it) and its sliding layers evicted by slot count, so this was refused."""
    target = make_target("qwen3")
    drafter = sliding_drafter(target, name).eval()
    block_size = drafter.config.block_size
    embedding = target.get_input_embeddings()
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(3, 36, drafter.fc.in_features, generator=generator)
    valid = (torch.rand(3, 36, generator=generator) > 0.3).long()
    valid[:, 0], valid[0, :4], valid[2, :9] = 1, 0, 0  # every row starts left-padded or not at all
    bonus_tokens = torch.randint(3, 100, (3, 6), generator=generator)
    block, rows, start = BlockDrafter(drafter, target), [0, 1, 2], 0
    with torch.no_grad():
        for round_index, new in enumerate([11, 5, 3, 7, 4, 6]):
            if round_index == 3:  # row 1 finishes: the cache keeps rows 0 and 2
                block.prune(torch.tensor([0, 2]))
                rows = [0, 2]
            block.add_context(features[rows, start : start + new], valid[rows, start : start + new])
            start += new
            cached = block.draft_hidden(bonus_tokens[rows, round_index], block_size)
            for index, row in enumerate(rows):
                ids = torch.full((1, block_size), drafter.config.mask_token_id)
                ids[0, 0] = bonus_tokens[row, round_index]
                context = features[row : row + 1, :start][:, valid[row, :start].bool()]
                whole = drafter(noise_embeds=embedding(ids), context_hidden_states=context).last_hidden_state
                assert (cached[index] - whole[0, 1:]).abs().max() < 1e-5, (round_index, row, context.shape[1])


@pytest.mark.parametrize("name", ["one_sliding_4_causal", "zlab_all_sliding_16_bidirectional"])
def test_batched_generation_with_a_sliding_drafter_matches_plain_batched_greedy(name):
    target = make_target("qwen3")
    drafter = sliding_drafter(target, name)
    input_ids, attention_mask = random_batch(torch.Generator().manual_seed(5), 4, shortest=3, longest=14)
    kwargs = dict(attention_mask=attention_mask, do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=PAD)
    expected = target.generate(input_ids, eos_token_id=None, **kwargs)
    assert torch.equal(target.generate(input_ids, assistant_model=drafter, eos_token_id=None, **kwargs), expected)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_the_packed_training_forward_is_the_served_function(name):
    """Every block of the packed training forward (5 anchors a chat, contexts up to 40 tokens: past every window)
    equals that block drafted alone over its context, as serving drafts it (fp32, < 1e-5). Before, training gave
    sliding layers full attention and a bidirectional block, a function no loop served."""
    target = make_target("qwen3")
    drafter = sliding_drafter(target, name).eval()
    assert packed_equals_served(drafter, drafter, target, drafter.config.block_size) < 1e-5


@pytest.mark.parametrize("name", ["one_sliding_4_causal", "zlab_all_sliding_16_bidirectional"])
def test_the_flex_training_masks_equal_the_dense_ones_for_every_layer_type(name):
    """The flex-attention masks (GPU training) encode each layer type's dense mask, window included, and give the
    same packed forward."""
    from hf_dflash.trainer import DFlashDataCollator, compute_target_features
    from hf_dflash.trainer.forward import dflash_training_forward, training_attention_masks
    from hf_dflash.trainer.maths import build_training_mask, training_mask_mod

    target = make_target("qwen3")
    drafter = sliding_drafter(target, name).eval()
    config = drafter.config
    collate = DFlashDataCollator(config.block_size, num_anchors=5, mask_token_id=config.mask_token_id, gamma=3.0)
    batch = collate(samples(count=2, length=40, seed=5))
    anchors, valid, seq_len = batch["anchor_positions"], batch["anchor_valid"], batch["input_ids"].shape[1]
    dense = training_attention_masks(config, anchors, valid, seq_len)
    dense = dense if isinstance(dense, dict) else {config.layer_types[0]: dense}
    assert set(dense) == set(config.layer_types)
    for layer_type, mask in dense.items():
        window = config.sliding_window if layer_type == SLIDING else None
        causal = window is not None and not config.sliding_window_non_causal
        assert torch.equal(mask, build_training_mask(anchors, valid, seq_len, config.block_size, window, causal))
        mask_mod = training_mask_mod(anchors, valid, seq_len, config.block_size, window, causal)
        queries, keys = torch.arange(mask.shape[2]), torch.arange(mask.shape[3])
        for row in range(2):
            assert torch.equal(mask_mod(torch.tensor(row), None, queries[:, None], keys[None, :]), mask[row, 0])
    features = compute_target_features(target, batch["input_ids"], config.target_layer_ids, batch["attention_mask"])
    outputs = {}
    # torch 2.13's CPU inductor cannot compile its flex-attention template when a second shape makes it recompile
    # with dynamic shapes (`cur_qSplitSize8` not declared): compile each case afresh.
    torch._dynamo.reset()
    for implementation in ("sdpa", "flex_attention"):
        drafter.set_attn_implementation(implementation)
        with torch.no_grad():
            outputs[implementation] = dflash_training_forward(
                drafter, target.get_input_embeddings(), batch, features, drafter.config
            )
    torch.testing.assert_close(outputs["flex_attention"], outputs["sdpa"], rtol=1e-4, atol=1e-5)


def test_sliding_masks_by_hand():
    """One anchor at position 5, block 4, window 3: slot k (position 5 + k) sees context j in (2 + k, 5) and, causal,
    block slots m in (k - 3, k]; bidirectional, every slot m > k - 3."""
    from hf_dflash.trainer.maths import build_training_mask

    anchors, valid = torch.tensor([[5]]), torch.tensor([[True]])
    causal = build_training_mask(anchors, valid, seq_len=8, block_size=4, sliding_window=3, block_causal=True)[0, 0]
    assert causal[:, :8].nonzero().tolist() == [[0, 3], [0, 4], [1, 4]]  # slot 2 (position 7) sees 5, 6: the block
    assert causal[:, 8:].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1]]
    both = build_training_mask(anchors, valid, seq_len=8, block_size=4, sliding_window=3)[0, 0]
    assert torch.equal(both[:, :8], causal[:, :8])
    assert both[:, 8:].int().tolist() == [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]]
    full = build_training_mask(anchors, valid, seq_len=8, block_size=4)[0, 0]
    assert full[:, :5].all() and not full[:, 5:8].any() and full[:, 8:].all()
