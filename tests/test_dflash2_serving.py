"""DFlash2 served (issue 34, part 2): the loop drafts by the candidate selector's walk (greedy: the argmax
path; sampling: each slot drawn from softmax(S / T) given the token drawn before it), and every mode stays
lossless: fp32 greedy output == plain greedy (chain, batch, hybrid, logits processors, Transformers' loop
with our candidate generator), sampling follows the target's distribution (chi-square)."""

import pytest
import torch

from hf_dflash import DFlashConfig, DFlashDraftModel
from hf_dflash.generation.drafting.draft_tree import best_first_tree_by
from hf_dflash.generation.drafting.selector import selector_chain, selector_drafts, selector_tree_children
from hf_dflash.generation.drafting.strategies import ChainDrafting
from hf_dflash.modeling_dflash.custom_generate import dflash_decoding
from hf_dflash.modeling_dflash.modeling_dflash import unary_top_k
from tests.conftest import make_target
from tests.helpers.compiled import WidthSpy, compiled_dflash
from tests.helpers.generation import (
    ALPHA,
    check_sampled_second_token,
    chi_square_against,
    prompt,
    random_batch,
    second_token_marginal,
    unpadded,
)
from tests.helpers.hybrid import prompt as repeating_prompt

DFLASH2 = dict(conv_kernel_size=2, conv_group_size=8, selector_rank=6, selector_top_k=4)


def dflash2_drafter(
    target, block_size: int = 4, seed: int = 1, draft_vocab_size: int | None = None
) -> DFlashDraftModel:
    """A random DFlash2 drafter for `target` whose selector is far from identity (it re-ranks candidates); with
    `draft_vocab_size`, drafting over that many random ids."""
    torch.manual_seed(seed)
    config = DFlashConfig.from_target_config(
        target.config, num_hidden_layers=2, block_size=block_size, num_target_features=2,
        draft_vocab_size=draft_vocab_size, **DFLASH2,
    )  # fmt: skip
    drafter = DFlashDraftModel(config).eval()
    if draft_vocab_size:
        drafter.set_draft_vocab(
            torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(seed))[:draft_vocab_size]
        )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in drafter.named_parameters():
            if "_conv." in name or name.startswith("candidate_selector."):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * (0.1 if "_conv." in name else 3))
    return drafter


@pytest.fixture
def proposals(monkeypatch):
    """Every chain proposal of the loop: (drafter outputs, bonus tokens, drafted tokens)."""
    seen = []
    original = ChainDrafting.proposal

    def spy(self, hidden, rows, prefixes, bonus, block_length):
        proposal = original(self, hidden, rows, prefixes, bonus, block_length)
        seen.append((self.block, hidden, bonus, proposal.drafts.tokens))
        return proposal

    monkeypatch.setattr(ChainDrafting, "proposal", spy)
    return seen


def test_the_loop_drafts_the_selector_walk_and_it_differs_from_the_argmax(proposals):
    target = make_target("qwen3")
    drafter = dflash2_drafter(target)
    input_ids = prompt(0)
    target.generate(input_ids, assistant_model=drafter, do_sample=False, max_new_tokens=24, eos_token_id=None)
    assert proposals
    differs = 0
    for block, hidden, bonus, tokens in proposals:
        assert torch.equal(tokens, selector_chain(drafter, hidden, block.lm_head, bonus).tokens)
        differs += int((tokens != drafter.draft_logits(hidden, block.lm_head).argmax(-1)).any())
    assert differs  # the selector steered at least one round away from DFlash's chain


def test_greedy_selector_scores_peak_at_the_draft_and_sampled_ones_are_distributions():
    target = make_target("qwen3")
    drafter = dflash2_drafter(target)
    hidden = torch.randn(3, 5, 32)
    logits = drafter.draft_logits(hidden, target.get_output_embeddings())
    anchors = torch.tensor([5, 9, 11])
    tokens, scores = selector_drafts(drafter, hidden, logits, anchors, do_sample=False)
    assert torch.equal(scores.argmax(-1), tokens)
    assert torch.isfinite(scores).sum(-1).eq(DFLASH2["selector_top_k"]).all()
    torch.manual_seed(0)
    tokens, probs = selector_drafts(drafter, hidden, logits, anchors, do_sample=True)
    assert torch.allclose(probs.sum(-1), torch.ones(3, 5)) and (probs.gather(-1, tokens[..., None]) > 0).all()
    assert probs.gt(0).sum(-1).le(DFLASH2["selector_top_k"]).all()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_greedy_chain_matches_plain_greedy(arch, block_size):
    target = make_target(arch)
    drafter = dflash2_drafter(target, block_size)
    for seed in range(2):
        input_ids = prompt(seed, length=5 + seed)
        kwargs = dict(do_sample=False, max_new_tokens=29, eos_token_id=None)
        assert torch.equal(
            target.generate(input_ids, assistant_model=drafter, **kwargs), target.generate(input_ids, **kwargs)
        )


def test_greedy_with_logits_processors_matches_plain_greedy():
    target = make_target("llama")
    drafter = dflash2_drafter(target)
    kwargs = dict(do_sample=False, max_new_tokens=25, eos_token_id=None, repetition_penalty=1.3, no_repeat_ngram_size=3)
    input_ids = prompt(3)
    assert torch.equal(
        target.generate(input_ids, assistant_model=drafter, **kwargs), target.generate(input_ids, **kwargs)
    )


def test_a_batch_of_ragged_rows_matches_plain_greedy_row_by_row():
    target = make_target("qwen3")
    drafter = dflash2_drafter(target, block_size=5)
    input_ids, attention_mask = random_batch(torch.Generator().manual_seed(2), batch_size=3)
    kwargs = dict(do_sample=False, max_new_tokens=20, eos_token_id=None, pad_token_id=0)
    out = target.generate(input_ids, attention_mask=attention_mask, assistant_model=drafter, **kwargs)
    for row in range(3):
        alone = unpadded(input_ids, attention_mask, row)
        expected = target.generate(alone, **kwargs)[0, alone.shape[1] :]
        assert torch.equal(out[row, input_ids.shape[1] :], expected)


def test_hybrid_drafting_matches_plain_greedy():
    target = make_target("llama")
    drafter = dflash2_drafter(target, block_size=4)
    drafter.block_size_policy = 4
    for seed, repeats in [(0, True), (1, False)]:
        input_ids = repeating_prompt(seed, repeats)
        kwargs = dict(do_sample=False, max_new_tokens=30, eos_token_id=None)
        actual = target.generate(input_ids, assistant_model=drafter, prompt_lookup_num_tokens=5, **kwargs)
        assert torch.equal(actual, target.generate(input_ids, **kwargs))
        assert drafter.last_acceptance.tree_sizes  # hybrid rounds ran


def test_sampling_preserves_the_target_distribution():
    target = make_target("qwen3", seed=3)
    check_sampled_second_token(target, dflash2_drafter(target, block_size=4, seed=4), "DFlash2 generate(do_sample)")


def test_transformers_loop_greedy_and_sampling(our_generator_in_transformers_loop):
    """Greedy == plain greedy; sampling: the 2nd new token follows its exact marginal and drafts were accepted."""
    target = make_target("qwen3", seed=3)
    drafter = dflash2_drafter(target, block_size=4, seed=4)
    input_ids = prompt(1)
    kwargs = dict(do_sample=False, max_new_tokens=20, eos_token_id=None)
    actual = target.generate(input_ids, assistant_model=drafter, speculation_type="dflash", **kwargs)
    assert torch.equal(actual, target.generate(input_ids, **kwargs))

    warpers = dict(temperature=0.8, top_k=40, top_p=0.95)
    prefix = torch.tensor([[5, 17, 33, 9, 71]])
    p_second = second_token_marginal(target, prefix, **warpers)
    torch.manual_seed(0)
    counts, accepted = torch.zeros_like(p_second), 0
    for _ in range(800):
        out = target.generate(
            prefix, do_sample=True, max_new_tokens=3, eos_token_id=None, assistant_model=drafter,
            speculation_type="dflash", **warpers,
        )  # fmt: skip
        counts[out[0, prefix.shape[1] + 1]] += 1
        accepted += sum(length > 1 for length in our_generator_in_transformers_loop[-1].stats.acceptance_lengths)
    assert chi_square_against(counts, p_second, "DFlash2 in Transformers' loop").pvalue > ALPHA
    assert accepted


def test_the_remote_code_loop_walks_the_selector_greedy_and_sampling():
    """The folder's `custom_generate` loop (self-contained file): greedy == plain greedy; sampling: the 2nd new
    token follows its exact marginal and drafts were accepted."""
    target = make_target("qwen3", seed=3)
    drafter = dflash2_drafter(target, block_size=4, seed=4)
    for seed in range(2):
        input_ids = prompt(seed)
        kwargs = dict(do_sample=False, max_new_tokens=25, eos_token_id=None)
        actual = target.generate(input_ids, custom_generate=dflash_decoding, dflash_drafter=drafter, **kwargs)
        assert torch.equal(actual, target.generate(input_ids, **kwargs))

    warpers = dict(temperature=0.8, top_k=40, top_p=0.95)
    prefix = torch.tensor([[5, 17, 33, 9, 71]])
    p_second = second_token_marginal(target, prefix, **warpers)
    torch.manual_seed(0)
    counts, forwards = torch.zeros_like(p_second), []
    handle = target.register_forward_pre_hook(lambda module, args: forwards.append(1))
    accepted = 0
    for _ in range(600):
        before = len(forwards)
        out = target.generate(
            prefix, custom_generate=dflash_decoding, dflash_drafter=drafter, do_sample=True, max_new_tokens=3,
            eos_token_id=None, **warpers,
        )  # fmt: skip
        counts[out[0, prefix.shape[1] + 1]] += 1
        accepted += len(forwards) - before < 3  # 3 tokens in fewer than 3 forwards: a draft was kept
    handle.remove()
    assert chi_square_against(counts, p_second, "DFlash2 custom_generate(do_sample)").pvalue > ALPHA
    assert accepted


@torch.no_grad()
def conditional_log_prob(drafter, hidden, logits, root: int, path: tuple[int, ...]) -> float:
    """log q(path) = sum_l log softmax(S_l | predecessor)[path_l] by the selector's definition, written out."""
    selector = drafter.candidate_selector
    candidates, unary = unary_top_k(logits.float(), selector.top_k)
    projected = selector.hidden_projection(hidden)
    total, predecessor = 0.0, root
    for slot, token in enumerate(path):
        pair = selector.successor_codebook[candidates[slot]] @ (
            selector.predecessor_codebook[predecessor] * projected[slot]
        )
        log_probs = (unary[slot] + pair).log_softmax(-1)
        total += float(log_probs[candidates[slot].tolist().index(token)])
        predecessor = token
    return total


@pytest.mark.parametrize("max_nodes", [2, 6, 20])
def test_a_selector_tree_holds_the_most_probable_continuations_and_its_spine_is_the_walk(max_nodes):
    target = make_target("qwen3")
    drafter = dflash2_drafter(target)
    generator = torch.Generator().manual_seed(max_nodes)
    hidden = torch.randn(3, 32, generator=generator)  # 3 draft slots, K = 4: 4 + 16 + 64 continuations
    lm_head = target.get_output_embeddings()
    with torch.no_grad():
        drafter.candidate_selector.hidden_projection.weight.mul_(0.03)  # no slot certain: no ties of probability
        logits = drafter.draft_logits(hidden, lm_head)
        tree, reach = best_first_tree_by(9, 3, selector_tree_children(drafter, hidden, logits), max_nodes)
        candidates = unary_top_k(logits, DFLASH2["selector_top_k"])[0].tolist()
        continuations = [()]
        for slot in range(3):
            continuations += [c + (t,) for c in continuations if len(c) == slot for t in candidates[slot]]
        scored = sorted((conditional_log_prob(drafter, hidden, logits, 9, c), c) for c in continuations[1:])[::-1]
        walk = selector_chain(drafter, hidden[None], lm_head, torch.tensor([9])).tokens[0].tolist()
    paths = {}
    for node in range(1, tree.num_nodes):
        paths[node] = paths.get(tree.parents[node], ()) + (int(tree.tokens[node]),)
        assert reach[node] == pytest.approx(conditional_log_prob(drafter, hidden, logits, 9, paths[node]), abs=1e-5)
    assert set(paths.values()) == {c for _, c in scored[: max_nodes - 1]}
    spine, node = [], 0  # from the root, each node's likeliest child: the greedy walk, as far as the tree goes
    while children := [child for child, parent in enumerate(tree.parents) if parent == node]:
        node = max(children, key=lambda child: reach[child])
        spine.append(int(tree.tokens[node]))
    assert spine == walk[: len(spine)] and spine


@pytest.mark.parametrize("draft_tree", [5, 16])
def test_selector_trees_match_plain_greedy(draft_tree):
    target = make_target("llama")
    drafter = dflash2_drafter(target, block_size=4)
    drafter.draft_tree = draft_tree
    for seed in range(2):
        input_ids = prompt(seed)
        kwargs = dict(do_sample=False, max_new_tokens=25, eos_token_id=None)
        assert torch.equal(
            target.generate(input_ids, assistant_model=drafter, **kwargs), target.generate(input_ids, **kwargs)
        )
        assert max(drafter.last_acceptance.tree_sizes) > 4  # trees, not chains, were verified


def test_sampling_over_selector_trees_preserves_the_target_distribution():
    target = make_target("qwen3", seed=3)
    drafter = dflash2_drafter(target, block_size=4, seed=4)
    drafter.draft_tree = 6
    check_sampled_second_token(target, drafter, "DFlash2 trees, generate(do_sample)")


@pytest.mark.slow
def test_compiled_verification_matches_plain_greedy():
    target = make_target("llama")
    drafter = dflash2_drafter(target, block_size=4)
    input_ids = prompt(0, length=9)
    expected = target.generate(input_ids, do_sample=False, max_new_tokens=23, eos_token_id=None)
    spy = WidthSpy(target)
    assert torch.equal(compiled_dflash(target, drafter, input_ids, 23), expected)
    assert set(spy.widths) == {4}  # the rounds ran compiled, one graph


@pytest.mark.parametrize("draft_tree", [None, 12])
def test_over_a_draft_vocabulary_drafts_stay_inside_it_and_match_plain_greedy(draft_tree, proposals):
    target = make_target("qwen3")
    drafter = dflash2_drafter(target, block_size=4, draft_vocab_size=24)
    drafter.draft_tree = draft_tree
    allowed = set(drafter.draft_token_ids.tolist())
    for seed in (2, 3):  # prompt(0)'s greedy reply meets a logit tie (87 vs 116, 1.5e-8 apart) that shapes flip
        input_ids = prompt(seed)
        kwargs = dict(do_sample=False, max_new_tokens=25, eos_token_id=None)
        assert torch.equal(
            target.generate(input_ids, assistant_model=drafter, **kwargs), target.generate(input_ids, **kwargs)
        )
    for block, hidden, bonus, tokens in proposals:  # chains: the walk over the draft ids
        assert set(tokens.flatten().tolist()) <= allowed
        assert torch.equal(tokens, selector_chain(drafter, hidden, block.lm_head, bonus).tokens)
    assert bool(proposals) == (draft_tree is None)


def test_a_dflash2_drafter_with_a_draft_vocabulary_has_no_official_layout(tmp_path):
    from hf_dflash.checkpoints import save_official

    drafter = dflash2_drafter(make_target("llama"), draft_vocab_size=24)
    with pytest.raises(ValueError, match="DFlash2 drafter with draft_vocab_size=24 has no official layout"):
        save_official(drafter, tmp_path / "official")
