"""SPEC §5 oracle 3: speculative sampling preserves the target distribution (chi-square)."""

import torch
from scipy.stats import chisquare

from hf_dflash.generation.verification import speculative_sample
from tests.conftest import make_drafter, make_target

ALPHA = 1e-3  # a correct sampler fails one run in a thousand


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


@torch.no_grad()
def exact_next_token_probs(target, input_ids, **warpers) -> torch.Tensor:
    """softmax of the processed target logits for the next token, as `generate` computes them."""
    config = target.generation_config
    processors = target._get_logits_processor(
        generation_config=type(config)(do_sample=True, **warpers),
        input_ids_seq_length=input_ids.shape[1],
        encoder_input_ids=input_ids,
        prefix_allowed_tokens_fn=None,
        logits_processor=None,
    )
    logits = target(input_ids).logits[:, -1].float()
    return processors(input_ids, logits).softmax(-1)[0]


@torch.no_grad()
def second_token_marginal(target, prefix: torch.LongTensor, **warpers) -> torch.Tensor:
    """Exact distribution of the 2nd new token: sum_t1 p(t1 | prefix) p(t2 | prefix, t1)."""
    p_first = exact_next_token_probs(target, prefix, **warpers)
    firsts = p_first.nonzero()[:, 0]
    extended = torch.cat([prefix.expand(len(firsts), -1), firsts[:, None]], -1)
    return p_first[firsts] @ torch.stack([exact_next_token_probs(target, row[None], **warpers) for row in extended])


def chi_square_against(counts: torch.Tensor, probs: torch.Tensor, label: str):
    """Chi-square of observed token counts against exact probabilities; low-probability bins are merged
    so every expected count is >= 5. Asserts no token outside the support was drawn."""
    support = probs > 0
    assert counts[~support].sum() == 0  # never a token the warpers removed
    expected = probs[support] * counts.sum()
    order = expected.argsort()
    observed, expected = counts[support][order], expected[order]
    small = expected.cumsum(0) < 5
    observed = torch.cat([observed[small].sum(0, keepdim=True), observed[~small]])
    expected = torch.cat([expected[small].sum(0, keepdim=True), expected[~small]])
    result = chisquare(observed.numpy(), (expected * observed.sum() / expected.sum()).numpy())
    print(f"{label}: chi2={result.statistic:.2f} over {len(observed)} bins, p={result.pvalue:.3f}")
    return result


@torch.no_grad()
def check_sampled_second_token(target, drafter, label: str, draws: int = 1200, **generate_kwargs) -> None:
    """End to end through `generate`: the 2nd new token (drafted, then verified by rejection sampling)
    follows its exact marginal sum_t1 p(t1) p(t2 | t1) under the target with the same warpers, and
    drafts really were accepted (acceptance is exercised, not only rejection)."""
    warpers = dict(temperature=0.8, top_k=40, top_p=0.95)
    prefix = torch.tensor([[5, 17, 33, 9, 71]])
    p_second = second_token_marginal(target, prefix, **warpers)
    torch.manual_seed(0)
    counts = torch.zeros_like(p_second)
    rounds = []
    for _ in range(draws):
        out = target.generate(
            prefix, do_sample=True, max_new_tokens=3, assistant_model=drafter, eos_token_id=None, **warpers,
            **generate_kwargs,
        )  # fmt: skip
        counts[out[0, prefix.shape[1] + 1]] += 1
        rounds += drafter.last_acceptance.acceptance_lengths
    assert chi_square_against(counts, p_second, label).pvalue > ALPHA
    assert max(rounds) >= 2


def test_generate_with_sampling_preserves_target_distribution():
    target = make_target("qwen3", seed=3)
    check_sampled_second_token(target, make_drafter(target, block_size=4, seed=4), "generate(do_sample)")
