"""The oracle: speculative sampling preserves the target distribution (chi-square)."""

import torch
from scipy.stats import chisquare

from hf_dflash.generation.verifying.acceptance_rules import speculative_sample
from tests.conftest import make_drafter, make_target
from tests.helpers.generation import ALPHA, check_sampled_second_token


def test_rejection_sampler_outputs_target_distribution():
    """Per slot: the first output token ~ p_0; given drafts kept, later tokens ~ p_i (vocab 6, k=3)."""
    generator = torch.Generator().manual_seed(0)
    vocab, k, draws = 6, 3, 30000
    target_probs = torch.softmax(torch.randn(1, k + 1, vocab, generator=generator) * 1.5, -1)
    draft_probs = torch.softmax(torch.randn(1, k, vocab, generator=generator) * 1.5, -1)
    first = torch.zeros(vocab)
    second_given_first_kept = torch.zeros(vocab)
    for _ in range(draws):
        drafts = torch.multinomial(draft_probs[0], 1, generator=generator).view(1, k)
        out = speculative_sample(drafts, draft_probs, target_probs, generator=generator)[0]
        first[out[0]] += 1
        if len(out) > 1:
            second_given_first_kept[out[1]] += 1
    first_test = chisquare(first, target_probs[0, 0] * draws)
    kept = second_given_first_kept.sum()
    second_test = chisquare(second_given_first_kept, target_probs[0, 1] * kept)
    print(
        f"slot 0: chi2={first_test.statistic:.2f} p={first_test.pvalue:.3f}; slot 1: chi2={second_test.statistic:.2f} p={second_test.pvalue:.3f}"
    )
    assert first_test.pvalue > ALPHA and second_test.pvalue > ALPHA


def test_rejection_sampler_accepts_identical_distributions():
    probs = torch.softmax(torch.randn(1, 5, 10), -1)
    drafts = torch.multinomial(probs[0, :4], 1).view(1, 4)
    assert speculative_sample(drafts, probs[:, :4], probs).shape[1] == 5


def test_generate_with_sampling_preserves_target_distribution():
    target = make_target("qwen3", seed=3)
    check_sampled_second_token(target, make_drafter(target, block_size=4, seed=4), "generate(do_sample)")
