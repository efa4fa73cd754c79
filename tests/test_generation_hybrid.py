"""Hybrid drafting: `generate(assistant_model=drafter, prompt_lookup_num_tokens=m)` verifies the DFlash block
and an n-gram continuation as one draft tree. Greedy output == plain greedy token for token (fp32) on 4
architectures, with random and always-right drafters, prompts with and without repeats, and every kind of
stop landing inside either branch; sampling keeps the target distribution (chi-square)."""

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, StoppingCriteria, StoppingCriteriaList

from hf_dflash import DFlashGenerateOutput
from hf_dflash.generation.policies.block_size import AdaptiveBlockSize
from hf_dflash.generation.policies.cost_model import CostModel
from hf_dflash.generation.verifying import target_forward
from tests.conftest import ARCHITECTURES, COMMON, VOCAB, OracleDrafter, make_drafter, make_target
from tests.helpers.generation import random_schedule, record_drafter_calls, reference_features
from tests.helpers.hybrid import prompt

GREEDY = dict(do_sample=False, eos_token_id=None)


def hybrid(target, drafter, input_ids, m=5, **kwargs):
    return target.generate(input_ids, assistant_model=drafter, prompt_lookup_num_tokens=m, **kwargs)


def committed(stats) -> int:
    """New tokens accounted for by the rounds (+ the prefill's token when the prefill drafted nothing)."""
    return sum(stats.acceptance_lengths) + (not stats.first_round_in_prefill)


def after_prefill(stats, values: list) -> list:
    """`values` per round without the prefill's round (when the prefill verified n-gram drafts)."""
    return values[1:] if stats.first_round_in_prefill else values


def oracle_for(target, input_ids, block_size, max_new_tokens):
    greedy = target.generate(input_ids, max_new_tokens=max_new_tokens + block_size, **GREEDY)
    config = make_drafter(target, block_size=block_size).config
    return OracleDrafter(config, target.get_output_embeddings().weight, greedy).eval()


class CountTreeForwards:
    """Counts the target forwards that verified a real tree (not a chain)."""

    def __init__(self, monkeypatch):
        self.count = 0
        original = target_forward.tree_inputs

        def counting(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(target_forward, "tree_inputs", counting)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("block_size", [2, 4, 16])
@pytest.mark.parametrize("repeats", [False, True])
def test_random_drafter_hybrid_matches_plain_greedy(arch, block_size, repeats, monkeypatch):
    """Full trees (the whole block + every n-gram draft found): the paths go through both branches."""
    trees = CountTreeForwards(monkeypatch)
    target = make_target(arch)
    drafter = make_drafter(target, block_size=block_size)
    drafter.block_size_policy = block_size
    for seed, m in [(0, 1), (1, 4), (2, 10)]:
        input_ids = prompt(seed, repeats)
        expected = target.generate(input_ids, max_new_tokens=37, **GREEDY)
        actual = hybrid(target, drafter, input_ids, m=m, max_new_tokens=37, **GREEDY)
        assert torch.equal(actual, expected)
        stats = drafter.last_acceptance
        assert committed(stats) == 37
        assert (
            len(stats.tree_sizes) == len(stats.block_tokens) == len(stats.ngram_tokens) == len(stats.acceptance_lengths)
        )
    assert trees.count > 0
    stats = drafter.last_acceptance
    assert sum(stats.ngram_tokens) > 0  # random tiny targets loop: the n-gram branch is accepted
    assert sum(stats.histogram) == len(stats.acceptance_lengths)  # rounds longer than the block are counted


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("block_size", [3, 8])
@pytest.mark.parametrize("max_new_tokens", [1, 2, 17, 30])
def test_oracle_drafter_hybrid_matches_and_never_overshoots(arch, block_size, max_new_tokens):
    target = make_target(arch)
    input_ids = prompt(3, repeats=True)
    drafter = oracle_for(target, input_ids, block_size, max_new_tokens)
    drafter.block_size_policy = block_size
    expected = target.generate(input_ids, max_new_tokens=max_new_tokens, **GREEDY)
    actual = hybrid(target, drafter, input_ids, m=6, max_new_tokens=max_new_tokens, **GREEDY)
    assert torch.equal(actual, expected)
    stats = drafter.last_acceptance
    assert committed(stats) == max_new_tokens
    # the DFlash branch is always right: every round commits at least the whole block (unless at the end;
    # a prefill that verified n-gram drafts had no block)
    assert all(tau >= block_size for tau in after_prefill(stats, stats.acceptance_lengths)[:-1])


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_random_block_schedule_and_eager_attention(arch, monkeypatch):
    trees = CountTreeForwards(monkeypatch)
    target = make_target(arch)
    target.set_attn_implementation("eager")
    drafter = make_drafter(target, block_size=6)
    drafter.block_size_policy = random_schedule(6, seed=len(arch))
    for seed in range(3):
        input_ids = prompt(seed, repeats=seed > 0)
        expected = target.generate(input_ids, max_new_tokens=40, **GREEDY)
        assert torch.equal(hybrid(target, drafter, input_ids, m=7, max_new_tokens=40, **GREEDY), expected)
        assert 1 in drafter.last_acceptance.block_sizes or seed < 2
    assert trees.count > 0


# --- stops inside either branch ---


def rounds(stats) -> list[tuple[int, int, int, int]]:
    """(offset of the round's first new token, drafts accepted, from the block, from the n-gram branch)."""
    offset, out = 0 if stats.first_round_in_prefill else 1, []  # else new token 0 comes from the prefill
    for tau, block, ngram in zip(stats.acceptance_lengths, stats.block_tokens, stats.ngram_tokens):
        out.append((offset, tau - 1, block, ngram))
        offset += tau
    return out


def offsets_inside(stats, branch: str) -> list[int]:
    """New-token offsets accepted from ONE branch only (the other branch disagreed there): stops placed
    there end the output inside that branch of a tree."""
    found = []
    for offset, accepted, block, ngram in rounds(stats):
        mine, other = (block, ngram) if branch == "block" else (ngram, block)
        found += [offset + j for j in range(other, mine) if j < accepted - 1]
    return found


class StopAtLength(StoppingCriteria):
    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.length, dtype=torch.bool)


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One character per token id (a..z, then Latin-1 letters): stop strings on the tiny vocabulary."""
    chars = [chr(ord("a") + i) for i in range(26)] + [chr(0xC0 + i) for i in range(VOCAB - 26)]
    backend = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="a"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def copying_prompts(target, input_ids: torch.LongTensor, count: int = 3) -> list[torch.LongTensor]:
    """Random tiny targets repeat themselves. Prompts = the prompt + its greedy continuation G up to a point j
    where G goes on with a 3-gram it wrote before: their own continuation starts by copying it from the
    prompt, so the tokens the n-gram branch drafts there are new in the generated text (an EOS or a stop
    string can be met there first)."""
    free = target.generate(input_ids, max_new_tokens=60, **GREEDY)[0, input_ids.shape[1] :].tolist()
    starts = [j for j in range(3, 50) if any(free[i : i + 4] == free[j - 1 : j + 3] for i in range(j - 1))]
    return [torch.cat([input_ids, torch.tensor([free[:j]])], 1) for j in starts[:count]]


def setups(branch: str):
    """(name, target, drafter, prompt, reference run's stats) with stops to place in `branch`: an always-right
    drafter on a prompt with repeats (paths through the block), a random drafter on prompts whose
    continuation it copies (paths through the n-gram branch)."""
    for arch in ("llama", "qwen3"):
        target = make_target(arch)
        input_ids = prompt(4, repeats=True)
        if branch == "block":
            runs = [(oracle_for(target, input_ids, 8, 60), input_ids)]
        else:
            runs = [(make_drafter(target, block_size=8), ids) for ids in copying_prompts(target, input_ids)]
        for drafter, ids in runs:
            drafter.block_size_policy = 8
            hybrid(target, drafter, ids, m=8, max_new_tokens=60, **GREEDY)
            yield arch, target, drafter, ids, drafter.last_acceptance


@pytest.mark.parametrize("branch", ["block", "ngram"])
def test_stops_landing_inside_either_branch(branch):
    """A custom criterion, EOS and a stop string met at a token accepted from one branch only end the
    output exactly where plain greedy ends it."""
    tokenizer = char_tokenizer()
    tried = {"custom": 0, "eos": 0, "stop string": 0}
    for name, target, drafter, input_ids, stats in setups(branch):
        length = input_ids.shape[1]
        free = target.generate(input_ids, max_new_tokens=60, **GREEDY)[0, length:].tolist()
        for offset in offsets_inside(stats, branch)[:4]:
            criteria = StoppingCriteriaList([StopAtLength(length + offset + 1)])
            kwargs = dict(max_new_tokens=60, do_sample=False, eos_token_id=None, stopping_criteria=criteria)
            actual = hybrid(target, drafter, input_ids, m=8, **kwargs)
            assert actual[0, length:].tolist() == free[: offset + 1], name
            tried["custom"] += 1
            if free[offset] not in free[:offset]:  # EOS: the first time the target writes this token
                actual = hybrid(target, drafter, input_ids, m=8, max_new_tokens=60, eos_token_id=free[offset])
                assert torch.equal(actual, target.generate(input_ids, max_new_tokens=60, eos_token_id=free[offset]))
                assert actual.shape[1] == length + offset + 1
                tried["eos"] += 1
            stop = tokenizer.decode(free[max(offset - 1, 0) : offset + 1])  # the 2 characters ending at offset
            text = tokenizer.decode(input_ids[0, -1:].tolist() + free)  # one character per token
            if offset and text.find(stop) == offset:  # the first time the sequence ends with the stop string
                kwargs = dict(
                    max_new_tokens=60, do_sample=False, eos_token_id=None, stop_strings=[stop], tokenizer=tokenizer
                )
                actual = hybrid(target, drafter, input_ids, m=8, **kwargs)
                assert torch.equal(actual, target.generate(input_ids, **kwargs))
                assert actual.shape[1] == length + offset + 1
                tried["stop string"] += 1
    assert all(tried.values()), tried


def test_max_new_tokens_inside_the_ngram_branch():
    """The n-gram drafts stop at max_length like the block's: rounds never overshoot."""
    target = make_target("mistral_gqa")
    input_ids = prompt(5, repeats=True)
    drafter = make_drafter(target, block_size=4)
    drafter.block_size_policy = 4
    for max_new_tokens in range(1, 26, 3):
        expected = target.generate(input_ids, max_new_tokens=max_new_tokens, **GREEDY)
        actual = hybrid(target, drafter, input_ids, m=10, max_new_tokens=max_new_tokens, **GREEDY)
        assert torch.equal(actual, expected)
        assert committed(drafter.last_acceptance) == max_new_tokens


# --- what the loop hands on: drafter features, outputs, logits processors ---


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@torch.no_grad()
def test_drafter_receives_the_features_of_exactly_the_committed_tokens(arch):
    """When the accepted path runs through the n-gram branch, the drafter still gets the target features of
    the committed tokens, once each, in order, at their own positions (not those of rejected nodes)."""
    target = make_target(arch)
    input_ids = prompt(6, repeats=True)
    drafter = make_drafter(target, block_size=5)
    drafter.block_size_policy = random_schedule(5, seed=7)
    calls, handle = record_drafter_calls(drafter)
    try:
        output = hybrid(target, drafter, input_ids, m=6, max_new_tokens=40, **GREEDY)
    finally:
        handle.remove()
    assert sum(drafter.last_acceptance.ngram_tokens) > sum(drafter.last_acceptance.block_tokens)
    positions, features = [], []
    for call in calls:
        context = call["context_hidden_states"].shape[1]
        positions += call["position_ids"][0, :context].tolist()
        features.append(call["context_hidden_states"][0])
        block = call["position_ids"][0, context:]
        assert block.tolist() == list(range(len(positions), len(positions) + call["noise_embeds"].shape[1]))
    assert positions == list(range(len(positions)))
    expected = reference_features(target, drafter, output[0])[: len(positions)]
    torch.testing.assert_close(torch.cat(features), expected, rtol=1e-4, atol=1e-4)


def test_return_dict_scores_logits_hidden_states_and_processors_match_plain():
    target = make_target("qwen2")
    input_ids = prompt(7, repeats=True)
    drafter = make_drafter(target, block_size=4)
    drafter.block_size_policy = 4
    kwargs = dict(
        do_sample=False,
        max_new_tokens=20,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
        output_hidden_states=True,
        repetition_penalty=1.3,  # reads input_ids: each tree node is processed with its own prefix
        no_repeat_ngram_size=4,
    )
    expected = target.generate(input_ids, **kwargs)
    actual = hybrid(target, drafter, input_ids, m=6, **kwargs)
    assert isinstance(actual, DFlashGenerateOutput)
    assert torch.equal(actual.sequences, expected.sequences)
    for mine, theirs in zip(actual.scores, expected.scores, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    for mine, theirs in zip(actual.logits, expected.logits, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    for mine, theirs in zip(actual.hidden_states, expected.hidden_states, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert max(drafter.last_acceptance.tree_sizes) > 4  # trees really were verified
    assert drafter.last_acceptance.first_round_in_prefill  # ... and n-gram drafts in the prefill


# --- fallbacks, budget, errors ---


def test_reachable_sliding_window_falls_back_to_one_branch_and_stays_lossless(monkeypatch):
    from transformers import MistralConfig, MistralForCausalLM

    trees = CountTreeForwards(monkeypatch)
    torch.manual_seed(0)
    target = MistralForCausalLM(
        MistralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, sliding_window=6)
    ).eval()
    drafter = make_drafter(target, block_size=4)
    drafter.block_size_policy = 4
    input_ids = prompt(8, repeats=True, length=12)
    expected = target.generate(input_ids, max_new_tokens=30, **GREEDY)
    assert torch.equal(hybrid(target, drafter, input_ids, m=5, max_new_tokens=30, **GREEDY), expected)
    stats = drafter.last_acceptance
    assert trees.count == 0 and sum(stats.ngram_tokens) > 0
    assert all(k == 1 or size <= k for k, size in zip(stats.block_sizes, stats.tree_sizes))  # one branch per round


def test_cost_model_keeps_the_tree_small_where_big_forwards_are_expensive():
    """Verification costs 1 s up to 16 tokens and 10 s above: the tree never exceeds 16 nodes. Where the
    drafter pass costs as much as verification and the (random) block is never accepted, the budget skips
    the drafter (k = 1) and drafts with the n-gram branch alone."""
    target = make_target("llama")
    input_ids = prompt(9, repeats=True)
    drafter = make_drafter(target, block_size=16)
    steep = CostModel.from_function(lambda k: 1.0, 16, lambda n: 1.0 if n <= 16 else 10.0, 32)
    drafter.block_size_policy = AdaptiveBlockSize(cost_model=steep)
    expected = target.generate(input_ids, max_new_tokens=60, **GREEDY)
    assert torch.equal(hybrid(target, drafter, input_ids, m=10, max_new_tokens=60, **GREEDY), expected)
    stats = drafter.last_acceptance
    assert max(stats.tree_sizes) <= 16 and after_prefill(stats, stats.block_sizes)[0] == 16

    flat = CostModel.from_function(lambda k: 1.0 + 1.0 * (k > 1), 16, lambda n: 1.0, 32)  # a drafter pass: 1 s
    drafter.block_size_policy = AdaptiveBlockSize(cost_model=flat)
    assert torch.equal(hybrid(target, drafter, input_ids, m=10, max_new_tokens=60, **GREEDY), expected)
    sizes = after_prefill(drafter.last_acceptance, drafter.last_acceptance.block_sizes)
    # the random block stops paying for its pass: later rounds skip it (it may be retried now and then)
    assert sizes[0] == 16 and sizes[2:].count(1) >= 0.8 * len(sizes[2:]), sizes


def test_default_policy_measures_the_cost_model_with_verification_passes(tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("HF_DFLASH_CACHE", str(tmp_path))
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=4)
    input_ids = prompt(10, repeats=True)
    expected = target.generate(input_ids, max_new_tokens=16, **GREEDY)
    assert torch.equal(hybrid(target, drafter, input_ids, m=4, max_new_tokens=16, **GREEDY), expected)
    (path,) = (tmp_path / "cost_models").glob("*.json")
    data = json.loads(path.read_text())
    assert data["verification_lengths"] == [1, 2, 4, 8] and set(data["verification_seconds"]) == {"1"}


def test_batched_hybrid_and_bad_settings_raise_with_the_fix():
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    batch = torch.randint(3, VOCAB, (2, 6))
    with pytest.raises(ValueError, match="batch size 1"):
        hybrid(target, drafter, batch, m=3, max_new_tokens=5, attention_mask=torch.ones_like(batch), **GREEDY)
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
        hybrid(target, drafter, prompt(0, False), m=0, max_new_tokens=5, **GREEDY)
    with pytest.raises(ValueError, match="max_matching_ngram_size"):
        hybrid(target, drafter, prompt(0, False), m=3, max_new_tokens=5, max_matching_ngram_size=-1, **GREEDY)


def test_real_target_hybrid_on_a_copy_prompt(real_target):
    """SmolLM2 asked to edit a function: hybrid == plain greedy and the n-gram branch carries the copy."""
    target, tokenizer = real_target
    code = "def mean(values):\n    total = 0\n    for value in values:\n        total = total + value\n    return total / len(values)\n"
    inputs = tokenizer.apply_chat_template(
        [
            {
                "role": "user",
                "content": f"Add a docstring to this Python function and return the whole function:\n```python\n{code}```",
            }
        ],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    torch.manual_seed(0)
    drafter = make_drafter(target, block_size=8, num_hidden_layers=1)
    drafter.block_size_policy = 8
    expected = target.generate(**inputs, do_sample=False, max_new_tokens=64)
    actual = target.generate(
        **inputs, do_sample=False, max_new_tokens=64, assistant_model=drafter, prompt_lookup_num_tokens=10
    )
    assert torch.equal(actual, expected), tokenizer.decode(actual[0])
    stats = drafter.last_acceptance
    assert sum(stats.ngram_tokens) >= 10 and stats.mean_acceptance_length > 1.5, stats


test_real_target_hybrid_on_a_copy_prompt = pytest.mark.real_model(test_real_target_hybrid_on_a_copy_prompt)


# --- sampling: both branches in one tree, recursive rejection sampling ---


def test_one_hot_draft_rejection_sampling_keeps_the_target_distribution():
    """An n-gram draft is deterministic (q = one-hot): accepted with probability p(draft), else resampled
    from p without it; the first output token ~ p (chi-square, vocab 6)."""
    from scipy.stats import chisquare

    from hf_dflash.generation.verifying.acceptance_rules import speculative_sample
    from tests.helpers.generation import ALPHA

    generator = torch.Generator().manual_seed(0)
    vocab, draws = 6, 30000
    target_probs = torch.softmax(torch.randn(1, 3, vocab, generator=generator) * 1.5, -1)
    drafts = torch.tensor([[2, 4]])
    one_hot = torch.nn.functional.one_hot(drafts, vocab).float()
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    for _ in range(draws):
        out = speculative_sample(drafts, one_hot, target_probs, generator=generator)[0]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    assert chisquare(first, target_probs[0, 0] * draws).pvalue > ALPHA
    assert chisquare(second, target_probs[0, 1] * second.sum()).pvalue > ALPHA


@torch.no_grad()
def test_hybrid_sampling_preserves_target_distribution():
    """generate(do_sample=True) in hybrid mode: the 2nd new token follows its exact marginal, with rounds
    that verified the n-gram chain, the block, and both as one tree among the runs."""
    from tests.helpers.generation import ALPHA, chi_square_against, second_token_marginal

    warpers = dict(temperature=0.8, top_k=40, top_p=0.95)
    target = make_target("qwen3", seed=3)
    drafter = make_drafter(target, block_size=4, seed=4)
    drafter.block_size_policy = random_schedule(4, seed=0)
    prefix = torch.arange(3, 43)[None]  # 40 distinct tokens: the bonus token usually occurred before
    p_second = second_token_marginal(target, prefix, **warpers)
    torch.manual_seed(0)
    counts = torch.zeros_like(p_second)
    ngram_rounds = block_rounds = both_rounds = 0
    for _ in range(1200):
        out = hybrid(target, drafter, prefix, m=3, max_new_tokens=3, eos_token_id=None, do_sample=True, **warpers)
        counts[out[0, prefix.shape[1] + 1]] += 1
        stats = drafter.last_acceptance
        ngram_rounds += sum(k == 1 and size > 1 for k, size in zip(stats.block_sizes, stats.tree_sizes))
        block_rounds += sum(k > 1 for k in stats.block_sizes)
        both_rounds += sum(k > 1 and size > k for k, size in zip(stats.block_sizes, stats.tree_sizes))
    assert chi_square_against(counts, p_second, "hybrid generate(do_sample)").pvalue > ALPHA
    assert ngram_rounds > 50 and block_rounds > 50 and both_rounds > 50, (ngram_rounds, block_rounds, both_rounds)


@torch.no_grad()
def test_hybrid_tree_sampling_preserves_target_distribution():
    """Sampling with the n-gram branch grafted onto the drafter's own tree (deterministic nodes throughout): the
    2nd new token follows its exact marginal, and rounds verified trees whose drafts the target accepted."""
    from tests.helpers.generation import ALPHA, chi_square_against, second_token_marginal

    warpers = dict(temperature=0.8, top_k=40, top_p=0.95)
    target = make_target("qwen3", seed=3)
    drafter = make_drafter(target, block_size=4, seed=4)
    drafter.draft_tree = 6
    # A flat synthetic cost model: the budget drafts the block (and its tree) every round. Left to the measured
    # one, a cost model timed on a busy machine priced the drafter's pass so high that no round drafted it.
    flat = CostModel.from_function(lambda k: 1.0, 4, lambda n: 1.0, 16)
    drafter.block_size_policy = AdaptiveBlockSize(cost_model=flat)
    prefix = torch.arange(3, 43)[None]
    p_second = second_token_marginal(target, prefix, **warpers)
    torch.manual_seed(0)
    counts = torch.zeros_like(p_second)
    tree_rounds = accepted = 0
    for _ in range(1000):
        out = hybrid(target, drafter, prefix, m=3, max_new_tokens=3, eos_token_id=None, do_sample=True, **warpers)
        counts[out[0, prefix.shape[1] + 1]] += 1
        stats = drafter.last_acceptance
        tree_rounds += sum(size > 4 for size in stats.tree_sizes)
        accepted += sum(length > 1 for length in stats.acceptance_lengths)
    assert chi_square_against(counts, p_second, "hybrid + drafter tree generate(do_sample)").pvalue > ALPHA
    assert tree_rounds > 50 and accepted >= 10, (tree_rounds, accepted)  # a random drafter: few accepted


@torch.no_grad()
def test_sampling_with_a_drafter_tree_that_is_a_chain_verifies_it_as_one():
    """A two-node drafter tree is a chain: verified by rejection sampling with one-hot draft distributions (its
    drafts carry none), in hybrid rounds that found no n-gram (it crashed there)."""
    target = make_target("qwen3", seed=3)
    drafter = make_drafter(target, block_size=4, seed=4)
    drafter.draft_tree = 2
    torch.manual_seed(0)
    for _ in range(5):
        out = hybrid(
            target,
            drafter,
            torch.tensor([[5, 17, 33, 9, 71]]),
            m=3,
            max_new_tokens=12,
            do_sample=True,
            eos_token_id=None,
        )
        assert out.shape[1] == 5 + 12
    assert drafter.last_acceptance.tree_sizes
