"""Oracles for the training maths: decay weights, anchors, blocks, mask, loss."""

import math

import pytest
import torch

from hf_dflash.trainer import (
    DFlashDataCollator,
    build_blocks,
    build_training_mask,
    decay_weights,
    default_decay_gamma,
    reply_offsets,
    select_anchors,
)
from hf_dflash.trainer.maths import acceptance_estimate


@pytest.mark.parametrize("block_size, gamma", [(16, 7.0), (10, 5.0), (8, 4.0)])
def test_decay_weights_closed_form_and_paper_gammas(block_size, gamma):
    assert default_decay_gamma(block_size) == gamma
    weights = decay_weights(block_size, gamma)
    assert weights[0] == 0
    for k in range(1, block_size):
        assert weights[k].item() == pytest.approx(math.exp(-(k - 1) / gamma))


def test_anchors_obey_the_rules_and_are_redrawn():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0, 0, 0, 0, 0]])
    allowed = [{2, 3, 6, 7, 8}, {1}]  # loss_mask[p] == loss_mask[p + 1] == 1
    draws = set()
    for seed in range(20):
        positions, valid = select_anchors(loss_mask, 3, torch.Generator().manual_seed(seed))
        assert positions.shape == (2, 3)
        for row in range(2):
            chosen = positions[row][valid[row]].tolist()
            assert set(chosen) <= allowed[row] and len(set(chosen)) == len(chosen)  # no replacement
            assert chosen == sorted(chosen)
        assert valid[0].all() and valid[1].tolist() == [True, False, False]
        draws.add(tuple(positions[0].tolist()))
    assert len(draws) > 1  # re-drawn: different anchors across steps
    positions, valid = select_anchors(loss_mask, 512)
    assert positions[0][valid[0]].tolist() == [2, 3, 6, 7, 8]  # capped at the candidates


def test_reply_offsets_restart_in_every_reply():
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 0, 1, 1], [1, 1, 0, 1, 0, 0, 0, 0]])
    assert reply_offsets(loss_mask).tolist() == [[0, 0, 1, 2, 0, 0, 0, 1], [0, 1, 0, 0, 0, 0, 0, 0]]


def test_weighted_anchors_obey_the_rules():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0, 0, 0, 0, 0]])
    allowed = [{2, 3, 6, 7, 8}, {1}]
    for seed in range(20):
        positions, valid = select_anchors(loss_mask, 3, torch.Generator().manual_seed(seed), decay_tokens=2.0)
        for row in range(2):
            chosen = positions[row][valid[row]].tolist()
            assert set(chosen) <= allowed[row] and len(set(chosen)) == len(chosen) and chosen == sorted(chosen)
        assert valid[0].all() and valid[1].tolist() == [True, False, False]
    positions, valid = select_anchors(loss_mask, 512, decay_tokens=2.0)
    assert positions[0][valid[0]].tolist() == [2, 3, 6, 7, 8]  # capped at the candidates, none lost to underflow


def test_uniform_anchors_are_unchanged_by_the_weighting_code():
    loss_mask = (torch.rand(3, 300, generator=torch.Generator().manual_seed(0)) > 0.2).long()
    for seed in range(5):
        default = select_anchors(loss_mask, 16, torch.Generator().manual_seed(seed))
        zero = select_anchors(loss_mask, 16, torch.Generator().manual_seed(seed), decay_tokens=0)
        assert all(torch.equal(a, b) for a, b in zip(default, zero))


def test_one_weighted_anchor_is_drawn_with_probability_proportional_to_its_weight():
    # a 41-token reply: candidates are offsets 0..39, weight 1 / (1 + d / 4)
    loss_mask = torch.tensor([[0] * 5 + [1] * 41])
    weights = 1.0 / (1.0 + torch.arange(40).float() / 4.0)
    expected = weights / weights.sum()
    draws = 20_000
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(40)
    for _ in range(draws // 500):  # 500 independent rows per call
        positions, _ = select_anchors(loss_mask.expand(500, -1), 1, generator, decay_tokens=4.0)
        counts += torch.bincount(positions[:, 0] - 5, minlength=40).float()
    chi2 = (((counts - draws * expected) ** 2) / (draws * expected)).sum().item()
    assert chi2 < 72.4  # chi-square, 39 degrees of freedom: p = 0.001
    assert counts[:10].sum() > 2 * counts[30:].sum()  # and the start of the reply dominates


def example_blocks(block_size=4, mask_token_id=9):
    input_ids = torch.tensor([[11, 12, 13, 14, 15, 16, 17, 9]])  # a REAL token 9 == mask id at the end
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    anchors, valid = torch.tensor([[2, 5, 0]]), torch.tensor([[True, True, False]])
    return (
        input_ids,
        loss_mask,
        anchors,
        valid,
        build_blocks(input_ids, loss_mask, anchors, valid, block_size, mask_token_id, 4.0),
    )


def test_blocks_use_same_position_labels_and_slot_masking():
    _, _, _, _, blocks = example_blocks()
    assert blocks["block_ids"][0, :8].tolist() == [13, 9, 9, 9, 16, 9, 9, 9]
    assert blocks["block_positions"][0, :8].tolist() == [2, 3, 4, 5, 5, 6, 7, 8]
    # slot k predicts the token AT p+k (not p+k+1): regression for next-token labels
    assert blocks["labels"][0, 1:4].tolist() == [14, 15, 16]
    weights = blocks["loss_weights"][0]
    gamma = 4.0
    assert weights[0] == 0 and weights[1] == pytest.approx(1.0) and weights[2] == pytest.approx(math.exp(-1 / gamma))
    # the real token 9 at position 7 keeps its label and weight (no value-based filtering)
    assert blocks["labels"][0, 6].item() == 9 and weights[6] > 0
    assert weights[7] == 0  # position 8 is past the sequence
    assert weights[8:].abs().sum() == 0  # padding anchor contributes nothing


def test_training_mask_is_strictly_before_anchor_and_block_local():
    _, _, anchors, valid, _ = example_blocks()
    mask = build_training_mask(anchors, valid, seq_len=8, block_size=4)[0, 0]
    assert mask.shape == (12, 8 + 12)
    context, blocks = mask[:, :8], mask[:, 8:]
    # block 0 (anchor 2) sees context 0, 1 but NOT position 2 (`<` not `<=`)
    assert context[:4].tolist() == [[True, True, False, False, False, False, False, False]] * 4
    assert context[4:8, :5].all() and not context[4:8, 5:].any()
    # bidirectional inside the block (slot 0 sees slot 3), nothing of other blocks
    assert blocks[0, 3] and blocks[3, 0]
    assert not blocks[:4, 4:].any() and not blocks[4:8, :4].any()
    # padding block: no context at all, only itself (no fully-masked row -> no NaN)
    assert not context[8:].any() and blocks[8:, 8:].all()
    assert mask.any(-1).all()


def test_collator_pads_right_and_builds_everything():
    collator = DFlashDataCollator(block_size=4, num_anchors=2, mask_token_id=99, gamma=4.0)
    batch = collator(
        [
            {"input_ids": [5, 6, 7, 8, 9, 10], "loss_mask": [0, 0, 1, 1, 1, 1]},
            {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
        ]
    )
    assert batch["input_ids"].tolist()[1] == [5, 6, 7, 0, 0, 0]
    assert batch["attention_mask"].tolist()[1] == [1, 1, 1, 0, 0, 0]
    assert batch["block_ids"].shape == batch["loss_weights"].shape == (2, 8)
    assert batch["anchor_valid"].tolist()[1] == [True, False]


def test_acceptance_estimate_from_slot_correctness():
    correct = torch.tensor([[False, True, True, False, False, True, False, True]])
    supervised = torch.ones_like(correct)
    right, seen, tau = acceptance_estimate(correct, supervised, block_size=4)
    assert right.tolist() == [2, 1, 1] and seen.tolist() == [2, 2, 2]
    assert tau.tolist() == [(1 + 2) + (1 + 1), 2]  # block 0 keeps 2 drafts, block 1 keeps 1


def test_dpace_weights_closed_form():
    """w_j = sum_{m >= j} prod_{i <= m} q~_i with q~ = (1 - alpha) q + alpha, cut at the first unsupervised slot."""
    from hf_dflash.trainer.maths import dpace_weights

    q = torch.tensor([[0.8, 0.4, 0.9, 0.6], [0.5, 0.5, 0.5, 0.5]])
    valid = torch.tensor([[True, True, True, True], [True, True, False, True]])
    alpha = 0.5
    weights = dpace_weights(q, valid, alpha)
    s = (1 - alpha) * q + alpha
    for j in range(4):
        expected = sum(math.prod(s[0, : m + 1].tolist()) for m in range(j, 4))
        assert weights[0, j].item() == pytest.approx(expected)
    # row 1: slot 2 unsupervised: weight 0 there, and slots 2.. add nothing to earlier weights
    assert weights[1].tolist() == pytest.approx([0.75 + 0.75**2, 0.75**2, 0.0, 0.0])
    # alpha = 1 ignores confidence: w_j = number of supervised slots from j on (the all-accepted chain)
    assert dpace_weights(q, torch.ones_like(valid), 1.0)[0].tolist() == [4.0, 3.0, 2.0, 1.0]
    assert not dpace_weights(q.requires_grad_(), valid).requires_grad
    with pytest.raises(ValueError, match="alpha"):
        dpace_weights(q, valid, 0.0)
