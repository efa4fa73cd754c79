"""Held-out τ under sampling (`trainer/sampling_tau.py`): the acceptance rules in closed form, and at a temperature
near 0 the estimate equals the greedy all-anchor τ that the served-walk estimate reads off the same forward."""

import pytest
import torch

from hf_dflash.trainer.consistency import served_tau_estimate
from hf_dflash.trainer.sampling_tau import draft_acceptance, expected_chain_tau, sampling_tau_estimate
from tests.test_consistency import oracle_on_a_40_token_reply


def test_acceptance_of_each_draft_rule_in_closed_form():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.1, 0.6, 0.1, 0.2])
    assert draft_acceptance(p, q, "sample").item() == pytest.approx(0.1 + 0.3 + 0.1)
    assert draft_acceptance(p, q, "argmax").item() == pytest.approx(0.3)
    assert draft_acceptance(p, q, "top-2").item() == pytest.approx(0.3 + 0.0)  # q's two best: ids 1 and 3
    assert draft_acceptance(p, q, "top-4").item() == pytest.approx(1.0)
    assert draft_acceptance(p, p, "sample").item() == pytest.approx(1.0)  # q = p: every draft accepted
    with pytest.raises(ValueError, match="Unknown draft rule 'top-0'"):
        draft_acceptance(p, q, "top-0")


def test_expected_chain_tau_stops_at_the_first_slot_without_a_draft():
    acceptance = torch.tensor([[0.5, 0.5, 0.5], [1.0, 1.0, 1.0]])
    drafted = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    assert expected_chain_tau(acceptance, drafted).tolist() == pytest.approx([1 + 0.5 + 0.25 + 0.125, 2.0])


def test_near_zero_temperature_equals_the_greedy_all_anchor_tau():
    target, prompt, plain, drafter = oracle_on_a_40_token_reply()
    sample = {"input_ids": plain[0].tolist(), "loss_mask": [0] * prompt.shape[1] + [1] * 40}
    greedy = served_tau_estimate(drafter, target, [sample]).uniform_tau
    estimate = sampling_tau_estimate(drafter, target, [sample], [1e-4, 1.0], anchors_per_forward=7)
    assert 1 < greedy < drafter.config.block_size
    for rule in ("sample", "argmax"):
        assert estimate[1e-4][rule] == pytest.approx(greedy, abs=1e-3)
    assert estimate[1.0]["top-4"] >= estimate[1.0]["top-2"] >= estimate[1.0]["argmax"]
    with pytest.raises(ValueError, match="temperatures"):
        sampling_tau_estimate(drafter, target, [sample], [0.0])


def test_a_draft_temperature_changes_the_sampled_drafts_only():
    target, prompt, plain, drafter = oracle_on_a_40_token_reply()
    sample = {"input_ids": plain[0].tolist(), "loss_mask": [0] * prompt.shape[1] + [1] * 40}
    at_call = sampling_tau_estimate(drafter, target, [sample], [0.7], anchors_per_forward=7)
    same = sampling_tau_estimate(drafter, target, [sample], [0.7], anchors_per_forward=7, draft_temperature=0.7)
    cooler = sampling_tau_estimate(drafter, target, [sample], [0.7], anchors_per_forward=7, draft_temperature=0.3)
    assert same == at_call
    assert cooler[0.7]["sample"] != at_call[0.7]["sample"]
    assert {rule: cooler[0.7][rule] for rule in ("argmax", "top-2")} == {
        rule: at_call[0.7][rule] for rule in ("argmax", "top-2")
    }
    with pytest.raises(ValueError, match="draft_temperature"):
        sampling_tau_estimate(drafter, target, [sample], [0.7], draft_temperature=0.0)


def test_several_draft_temperatures_in_one_pass_equal_one_at_a_time():
    from hf_dflash.trainer.sampling_tau import draft_temperature_taus

    target, prompt, plain, drafter = oracle_on_a_40_token_reply()
    sample = {"input_ids": plain[0].tolist(), "loss_mask": [0] * prompt.shape[1] + [1] * 40}
    together = draft_temperature_taus(drafter, target, [sample], [0.7, 1.0], [0.3, 0.7])
    for draft_t in (0.3, 0.7):
        alone = sampling_tau_estimate(drafter, target, [sample], [0.7, 1.0], ("sample",), 32, draft_t)
        assert together[draft_t] == {t: by_rule["sample"] for t, by_rule in alone.items()}
    with pytest.raises(ValueError, match="draft_temperature"):
        draft_temperature_taus(drafter, target, [sample], [0.7], [-1.0])
