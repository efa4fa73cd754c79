"""Adaptive block size (`hf_dflash.generation.policies.block_size` and `.cost_model`): the estimator maths by hand,
losslessness under random per-round block sizes (single and batched), the policy's convergence, and
the cost-model cache."""

import functools
import json
from fractions import Fraction

import pytest
import torch

from hf_dflash.generation.policies.block_size import (
    AdaptiveBlockSize,
    AdaptiveController,
    acceptance_probabilities,
    best_block_size,
    expected_tokens,
    parse_block_size_policy,
    update_acceptance_counts,
)
from hf_dflash.generation.policies.cost_model import CostModel, measured_block_lengths
from hf_dflash.generation.policies.cost_timing import (
    cost_model_key,
    cost_model_path,
    measure_round_seconds,
    measured_cost_model,
)
from tests.conftest import ARCHITECTURES, VOCAB, OracleDrafter, make_drafter, make_target
from tests.helpers.generation import (
    LINEAR_COST,
    PAD,
    FakeMeasure,
    random_batch,
    random_schedule,
    record_drafter_calls,
    reference_features,
    unpadded,
)


def tensor(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# --- estimator, E(k), argmax (hand-computed) ---


def test_update_acceptance_counts_by_hand():
    successes, trials = torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, 4, dtype=torch.float64)
    # round 1: 4 drafts each; row 0 accepts 2 (slot 2 reached and rejected, slot 3 never reached), row 1 all
    successes, trials = update_acceptance_counts(successes, trials, torch.tensor([4, 4]), torch.tensor([2, 4]), 0.5)
    assert successes.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert trials.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    # round 2: 2 drafts each (slots 2, 3 not offered: no trial); row 0 accepts none, row 1 both
    successes, trials = update_acceptance_counts(successes, trials, torch.tensor([2, 2]), torch.tensor([0, 2]), 0.5)
    assert successes.tolist() == [[0.5, 0.5, 0, 0], [1.5, 1.5, 0.5, 0.5]]
    assert trials.tolist() == [[1.5, 0.5, 0.5, 0], [1.5, 1.5, 0.5, 0.5]]
    # round 3: k = 1 (no drafts): evidence only fades
    successes, trials = update_acceptance_counts(successes, trials, torch.tensor([0, 0]), torch.tensor([0, 0]), 0.5)
    assert successes.tolist() == [[0.25, 0.25, 0, 0], [0.75, 0.75, 0.25, 0.25]]
    assert trials.tolist() == [[0.75, 0.25, 0.25, 0], [0.75, 0.75, 0.25, 0.25]]


def test_acceptance_probabilities_shrink_toward_prior_then_previous_slot():
    p = acceptance_probabilities(tensor([[0.5, 0.5, 0, 0]]), tensor([[1.5, 0.5, 0.5, 0]]), prior=1.0, prior_weight=1.0)
    p0 = Fraction(3, 2) / Fraction(5, 2)  # (0.5 + 1 * 1) / (1.5 + 1)
    p1 = (Fraction(1, 2) + p0) / Fraction(3, 2)
    p2 = (0 + p1) / Fraction(3, 2)
    p3 = p2  # never tried: exactly the slot before
    torch.testing.assert_close(p, tensor([[float(p0), float(p1), float(p2), float(p3)]]))
    fresh = acceptance_probabilities(
        torch.zeros(3, 5, dtype=torch.float64), torch.zeros(3, 5, dtype=torch.float64), 0.7, 2.0
    )
    assert torch.allclose(fresh, torch.full((3, 5), 0.7, dtype=torch.float64))  # no evidence: the prior


def test_expected_tokens_by_hand():
    expected = expected_tokens(tensor([[0.5, 0.5, 1.0], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]]))
    assert expected.tolist() == [[1, 1.5, 1.75, 2.0], [1, 2, 3, 4], [1, 1, 1, 1]]


def test_best_block_size_by_hand():
    # tokens per second 1, 1.2, 1.1667, 1.0 -> k = 2
    assert best_block_size(tensor([[1, 1.5, 1.75, 2.0]]), tensor([1, 1.25, 1.5, 2.0])) == 2
    # a batch sums its rows: (2, 3, 4, 5) / (1, 1.5, 2, 2.4) -> k = 4
    assert best_block_size(tensor([[1, 2, 3, 4], [1, 1, 1, 1]]), tensor([1, 1.5, 2, 2.4])) == 4
    # ties go to the smaller (cheaper) block
    assert best_block_size(tensor([[1, 2, 3, 4], [1, 1, 1, 1]]), tensor([1, 1.5, 2, 2.5])) == 1
    # optimistic start (every p = 1) with sublinear cost: the whole block
    all_accepted = expected_tokens(torch.ones(1, 15, dtype=torch.float64))
    assert best_block_size(all_accepted, tensor([LINEAR_COST(k) for k in range(1, 17)])) == 16


def test_controller_keeps_per_row_estimates():
    policy = AdaptiveBlockSize(cost_model=CostModel.from_function(LINEAR_COST, 8))
    controller = AdaptiveController(policy, max_block_size=8, batch_size=3, cost_model=policy.cost_model)
    assert controller.choose([0, 1, 2]) == 8  # optimistic start
    for _ in range(30):  # row 0 accepts every draft, row 1 none, row 2 is not in the batch any more
        controller.observe([0, 1], 7, torch.tensor([7, 0]))
    assert controller.choose([0]) == 8
    assert controller.choose([1]) == 1
    assert controller.choose([0, 1]) == 8  # row 0's 7 extra tokens outweigh the cost for both rows
    assert controller.choose([2]) == 8  # untouched row: still the prior


# --- cost model ---


def test_cost_model_interpolates_block_lengths_and_rows():
    model = CostModel((1, 4, 8), {1: (1.0, 1.6, 2.4), 4: (2.0, 4.0, 6.0)})
    torch.testing.assert_close(model.round_seconds(1, 10), tensor([1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.2, 2.4, 2.6, 2.8]))
    between = model.round_seconds(2, 4)  # a third of the way from 1 to 4 rows
    torch.testing.assert_close(between, tensor([4 / 3, 4 / 3 + (2.4 - 4 / 3) / 3, 4 / 3 + 2 * (2.4 - 4 / 3) / 3, 2.4]))
    torch.testing.assert_close(model.round_seconds(8, 1), tensor([4.0]))  # above the largest: proportional
    only_larger = CostModel((1, 4, 8), {4: (2.0, 4.0, 6.0), 8: (3.0, 7.0, 11.0)})
    torch.testing.assert_close(only_larger.round_seconds(1, 4), tensor([2.0, 2 + 2 / 3, 2 + 4 / 3, 4.0]))  # smallest
    assert measured_block_lengths(16) == (1, 2, 4, 8, 16)
    assert measured_block_lengths(5) == (1, 2, 4, 5)
    assert measured_block_lengths(32) == (1, 2, 4, 8, 16, 32)


@pytest.mark.parametrize(
    "lengths, seconds, match",
    [
        ((2, 4), {1: (1.0, 2.0)}, "increase from 1"),
        ((1, 1), {1: (1.0, 2.0)}, "increase from 1"),
        ((1, 4), {1: (1.0,)}, "2 positive seconds"),
        ((1, 4), {1: (1.0, -2.0)}, "positive"),
        ((1, 4), {}, "empty"),
        ((1, 4), {0: (1.0, 2.0)}, "row counts"),
    ],
)
def test_cost_model_rejects_malformed_tables(lengths, seconds, match):
    with pytest.raises(ValueError, match=match):
        CostModel(lengths, seconds)


def test_cost_model_cache_round_trip(tmp_path):
    target = make_target("llama")
    drafter = make_drafter(target, block_size=8)
    measure = FakeMeasure()
    first = measured_cost_model(target, drafter, (1,), tmp_path, measure)
    assert measure.calls == [1] and first.block_lengths == (1, 2, 4, 8)
    path = cost_model_path(cost_model_key(target, drafter), tmp_path)
    assert path.parent == tmp_path / "cost_models" and path.is_file()
    assert json.loads(path.read_text())["key"] == cost_model_key(target, drafter)
    assert measured_cost_model(target, drafter, (1,), tmp_path, measure) == first and measure.calls == [1]
    both = measured_cost_model(target, drafter, (1, 4), tmp_path, measure)  # only the new row count is timed
    assert measure.calls == [1, 4] and set(both.seconds) == {1, 4} and both.seconds[1] == first.seconds[1]
    assert list(tmp_path.glob("cost_models/*")) == [path]  # no temporary file left behind


@pytest.mark.parametrize("content", ["{not json", '{"format": 1}', "[1, 2]", '{"format": 1, "key": "x"}'])
def test_corrupt_cost_model_cache_is_measured_again(tmp_path, content):
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    path = cost_model_path(cost_model_key(target, drafter), tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text(content)
    measure = FakeMeasure()
    with pytest.warns(UserWarning, match="Ignoring the DFlash cost model cache"):
        model = measured_cost_model(target, drafter, (1,), tmp_path, measure)
    assert measure.calls == [1]
    assert measured_cost_model(target, drafter, (1,), tmp_path, measure) == model and measure.calls == [1]


@pytest.mark.parametrize("timed_together", [False, True])
def test_a_cached_model_whose_two_timings_of_one_forward_disagree_is_timed_again(tmp_path, timed_together):
    """A round of block length 1 and a verification pass of 1 token are the same forward, timed at different
    times: a file where one is 1.5x the other was partly timed while something else ran, and is timed again
    (both tables, in one go: then a disagreement is the machine's own and the file is kept)."""
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    measure, verify_calls = FakeMeasure(), []

    def measure_verification(target, drafter, rows, lengths):
        verify_calls.append(rows)
        return [rows * LINEAR_COST(n) for n in lengths]

    def measure_drafting(target, drafter, rows, lengths):
        return [0.01 * rows * (k > 1) for k in lengths]

    kwargs = dict(
        measure=measure, verification=True, measure_verification=measure_verification, measure_drafting=measure_drafting
    )
    model = measured_cost_model(target, drafter, (1,), tmp_path, **kwargs)
    assert measure.calls == verify_calls == [1]
    path = cost_model_path(cost_model_key(target, drafter), tmp_path)
    data = json.loads(path.read_text())
    assert data["timed_together"] is True
    data["verification_seconds"]["1"] = [3 * s for s in data["verification_seconds"]["1"]]  # timed under load
    data["timed_together"] = timed_together
    path.write_text(json.dumps(data))
    if timed_together:
        assert measured_cost_model(target, drafter, (1,), tmp_path, **kwargs) != model  # kept as the machine's
        assert measure.calls == verify_calls == [1]
        return
    with pytest.warns(UserWarning, match="timed while something else ran"):
        assert measured_cost_model(target, drafter, (1,), tmp_path, **kwargs) == model
    assert measure.calls == verify_calls == [1, 1]


def test_unwritable_cost_model_cache_only_warns(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    target = make_target("llama")
    measure = FakeMeasure()
    with pytest.warns(UserWarning, match="Could not cache the DFlash cost model"):
        model = measured_cost_model(target, make_drafter(target, block_size=4), (1,), not_a_folder, measure)
    assert measure.calls == [1] and model.block_lengths == (1, 2, 4)


def test_cost_model_fingerprint_separates_models_and_machines(tmp_path, monkeypatch):
    target = make_target("llama")
    drafter = make_drafter(target, block_size=8)
    key = cost_model_key(target, drafter)
    assert cost_model_key(make_target("llama", seed=5), make_drafter(target, block_size=8, seed=3)) == key  # weights
    # a recommendation for serving, not a cost: flipping it must not throw a machine's timings away
    assert cost_model_key(target, make_drafter(target, block_size=8, block_size_policy="confidence")) == key
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        other_threads = cost_model_key(target, drafter)
    finally:
        torch.set_num_threads(threads)
    others = [
        cost_model_key(make_target("qwen3"), make_drafter(make_target("qwen3"), block_size=8)),
        cost_model_key(target, make_drafter(target, block_size=16)),
        cost_model_key(target, make_drafter(target, block_size=8, num_hidden_layers=1)),
        cost_model_key(make_target("llama").to(torch.bfloat16), make_drafter(target, block_size=8).to(torch.bfloat16)),
        other_threads,
    ]
    # verification timed after another context length: measured again, not read from the old file
    monkeypatch.setattr("hf_dflash.generation.policies.cost_timing.VERIFICATION_CONTEXT", 64)
    others.append(cost_model_key(target, drafter))
    paths = {cost_model_path(k, tmp_path) for k in [key, *others]}
    assert len(paths) == len(others) + 1


def test_real_measurement_is_positive_and_leaves_rng_alone():
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=5)
    state = torch.get_rng_state()
    seconds = measure_round_seconds(target, drafter, rows=2, block_lengths=(1, 2, 5), repeats=1)
    assert len(seconds) == 3 and all(s > 0 for s in seconds)
    assert torch.equal(torch.get_rng_state(), state)  # sampling after a measurement is unchanged


# --- API ---


@pytest.mark.parametrize("policy", [0, 5, -1, 2.5, True, "adaptve", "4", [4]])
def test_invalid_policy_is_refused_with_the_fix(policy):
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    drafter.block_size_policy = policy
    with pytest.raises(ValueError, match=r"block_size_policy = .* 1 <= k <= 4, 'adaptive'"):
        target.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, assistant_model=drafter)


@pytest.mark.parametrize("bad", [0, 5, 2.0])
@pytest.mark.parametrize("batch", [1, 2])
def test_schedule_returning_an_invalid_block_size_is_refused(bad, batch):
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    drafter.block_size_policy = lambda round_index: 3 if round_index < 2 else bad
    with pytest.raises(ValueError, match=rf"schedule returned {bad!r} for round 2; .* 1 <= k <= 4"):
        target.generate(
            torch.tensor([[5, 6, 7]] * batch), max_new_tokens=20, eos_token_id=None, assistant_model=drafter
        )


def test_invalid_adaptive_settings():
    for kwargs in ({"decay": 0.0}, {"decay": 1.5}, {"prior": 1.2}, {"prior_weight": 0}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            AdaptiveBlockSize(**kwargs)


# --- losslessness under random schedules ---


@functools.cache
def free_run(arch: str, max_new_tokens: int = 40):
    """(target, prompt (1, 7), plain greedy continuation without EOS (1, 7 + max_new_tokens))."""
    target = make_target(arch)
    prompt = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(len(arch)))
    return target, prompt, target.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None)


def check_stats(stats, max_block_size):
    assert len(stats.block_sizes) == len(stats.acceptance_lengths)
    assert all(1 <= tau <= k <= max_block_size for tau, k in zip(stats.acceptance_lengths, stats.block_sizes))


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("block_size", [2, 5, 16])
def test_random_schedule_matches_plain_greedy(arch, block_size):
    target, prompt, free = free_run(arch)
    # random drafter, EOS = a token the target emits mid-way: stops land inside blocks of every size
    generated = free[0, prompt.shape[1] :].tolist()
    eos = generated[9 + block_size]
    expected = free[:, : prompt.shape[1] + generated.index(eos) + 1]
    drafter = make_drafter(target, block_size=block_size)
    drafter.block_size_policy = random_schedule(block_size, seed=block_size)
    actual = target.generate(prompt, do_sample=False, max_new_tokens=30, eos_token_id=eos, assistant_model=drafter)
    assert torch.equal(actual, expected)
    check_stats(drafter.last_acceptance, block_size)
    assert sum(drafter.last_acceptance.acceptance_lengths) + 1 == expected.shape[1] - prompt.shape[1]

    # oracle drafter: every round accepts its whole block, whatever its length
    oracle = OracleDrafter(drafter.config, target.get_output_embeddings().weight, free).eval()
    oracle.block_size_policy = random_schedule(block_size, seed=block_size + 1)
    actual = target.generate(prompt, do_sample=False, max_new_tokens=23, eos_token_id=None, assistant_model=oracle)
    assert torch.equal(actual, free[:, : prompt.shape[1] + 23])
    stats = oracle.last_acceptance
    check_stats(stats, block_size)
    assert stats.acceptance_lengths[:-1] == stats.block_sizes[:-1]  # only the last round is cut by max_new_tokens
    assert sum(stats.acceptance_lengths) + 1 == 23


@functools.cache
def free_batch(arch: str, max_new_tokens: int = 36):
    """(target, left-padded batch of 4, its mask, plain batched greedy without EOS)."""
    target = make_target(arch)
    input_ids, attention_mask = random_batch(torch.Generator().manual_seed(len(arch)), 4)
    free = target.generate(
        input_ids,
        attention_mask=attention_mask,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=PAD,
    )
    return target, input_ids, attention_mask, free


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("block_size", [2, 5, 16])
def test_random_schedule_matches_plain_batched_greedy(arch, block_size):
    target, input_ids, attention_mask, free = free_batch(arch)
    width = input_ids.shape[1]
    kwargs = dict(attention_mask=attention_mask, do_sample=False, pad_token_id=PAD)
    # random drafter; EOS = a token of row 1 mid-way: rows stop at different times, finished rows leave
    eos = int(free[1, width + 5 + block_size])
    expected = target.generate(input_ids, max_new_tokens=20, eos_token_id=eos, **kwargs)
    drafter = make_drafter(target, block_size=block_size)
    drafter.block_size_policy = random_schedule(block_size, seed=block_size)
    actual = target.generate(input_ids, max_new_tokens=20, eos_token_id=eos, assistant_model=drafter, **kwargs)
    assert torch.equal(actual, expected)
    assert max(drafter.last_acceptance.block_sizes) <= block_size

    # oracle drafter reading the plain batched continuation of each row (by true position), with 30% of
    # its tokens wrong so rows accept different partial blocks of every length
    rows = [torch.cat([unpadded(input_ids, attention_mask, b)[0], free[b, width:]]) for b in range(len(input_ids))]
    greedy = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=PAD)
    noise = torch.Generator().manual_seed(block_size)
    replace = torch.rand(greedy.shape, generator=noise) < 0.3
    greedy[replace] = torch.randint(3, VOCAB, (int(replace.sum()),), generator=noise)
    oracle = OracleDrafter(
        drafter.config,
        target.get_output_embeddings().weight,
        greedy,
        embedding_weight=target.get_input_embeddings().weight,
    ).eval()
    oracle.block_size_policy = random_schedule(block_size, seed=block_size + 1)
    actual = target.generate(input_ids, max_new_tokens=19, eos_token_id=None, assistant_model=oracle, **kwargs)
    assert torch.equal(actual, free[:, : width + 19])
    if block_size > 2:
        assert len(set(oracle.last_acceptance.acceptance_lengths)) > 2


@pytest.mark.parametrize("policy", [1, 3])
def test_fixed_shorter_block_and_sliding_window_target(policy):
    """An int policy drafts k - 1 tokens every round (k = 1: plain decoding); a sliding-window target
    rolls back what each block length leaves behind."""
    from transformers import MistralConfig, MistralForCausalLM

    from tests.conftest import COMMON

    torch.manual_seed(0)
    target = MistralForCausalLM(
        MistralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, sliding_window=6)
    ).eval()
    drafter = make_drafter(target, block_size=8)
    drafter.block_size_policy = policy
    prompt = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(8))
    kwargs = dict(do_sample=False, max_new_tokens=25, eos_token_id=None)
    assert torch.equal(target.generate(prompt, assistant_model=drafter, **kwargs), target.generate(prompt, **kwargs))
    assert set(drafter.last_acceptance.block_sizes) == {policy}
    drafter.block_size_policy = random_schedule(8, seed=0)
    assert torch.equal(target.generate(prompt, assistant_model=drafter, **kwargs), target.generate(prompt, **kwargs))


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@torch.no_grad()
def test_every_committed_token_reaches_the_drafter_once_in_order(arch):
    """Rounds with k = 1 skip the drafter; the features of the tokens they commit wait for the next
    drafter pass. Over a random schedule the drafter sees each committed token's features exactly once,
    at its own position, and each block right after them."""
    target, prompt, free = free_run(arch)
    drafter = make_drafter(target, block_size=5)
    drafter.block_size_policy = random_schedule(5, seed=3)
    calls, handle = record_drafter_calls(drafter)
    try:
        output = target.generate(prompt, do_sample=False, max_new_tokens=30, eos_token_id=None, assistant_model=drafter)
    finally:
        handle.remove()
    assert 1 in drafter.last_acceptance.block_sizes and len(calls) < len(drafter.last_acceptance.block_sizes)
    positions, features = [], []
    for call in calls:
        context = call["context_hidden_states"].shape[1]
        block = call["position_ids"][0, context:]
        positions += call["position_ids"][0, :context].tolist()
        features.append(call["context_hidden_states"][0])
        assert block.tolist() == list(range(len(positions), len(positions) + call["noise_embeds"].shape[1]))
    drafted = [k for k in drafter.last_acceptance.block_sizes if k > 1]
    lengths = [call["noise_embeds"].shape[1] for call in calls]
    assert lengths == drafted[: len(lengths)] and len(drafted) - len(lengths) <= 1  # the last may hit max_length
    assert positions == list(range(len(positions)))
    expected = reference_features(target, drafter, output[0])[: len(positions)]
    torch.testing.assert_close(torch.cat(features), expected, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_batched_rows_give_the_drafter_each_committed_token_once_in_order():
    """Batched: per row, the valid new context slots of all drafter passes are that row's committed
    tokens, in order, at their own positions (holes and compaction included); blocks follow them."""
    target, input_ids, attention_mask, free = free_batch("llama")
    drafter = make_drafter(target, block_size=5)
    drafter.block_size_policy = random_schedule(5, seed=4)
    calls, handle = record_drafter_calls(drafter)
    try:
        output = target.generate(
            input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=30,
            eos_token_id=None,
            pad_token_id=PAD,
            assistant_model=drafter,
        )
    finally:
        handle.remove()
    assert torch.equal(output, free[:, : input_ids.shape[1] + 30])
    assert 1 in drafter.last_acceptance.block_sizes
    for row in range(len(input_ids)):
        positions, features = [], []
        for call in calls:
            context = call["context_hidden_states"].shape[1]
            valid = call["attention_mask"][row, call["past"] : call["past"] + context].bool()
            positions += call["position_ids"][row, :context][valid].tolist()
            features.append(call["context_hidden_states"][row][valid])
            block = call["position_ids"][row, context:].tolist()
            assert block == list(range(len(positions), len(positions) + call["noise_embeds"].shape[1]))
        assert positions == list(range(len(positions)))
        sequence = torch.cat([unpadded(input_ids, attention_mask, row)[0], output[row, input_ids.shape[1] :]])
        expected = reference_features(target, drafter, sequence)[: len(positions)]
        torch.testing.assert_close(torch.cat(features), expected, rtol=1e-4, atol=1e-4)


# --- the adaptive policy ---


def test_adaptive_policy_converges_to_full_blocks_with_an_oracle_and_short_ones_with_a_random_drafter():
    target, prompt, free = free_run("llama")
    cost_model = CostModel.from_function(LINEAR_COST, 8)
    oracle = OracleDrafter(
        make_drafter(target, block_size=8).config, target.get_output_embeddings().weight, free
    ).eval()
    oracle.block_size_policy = AdaptiveBlockSize(cost_model=cost_model)
    output = target.generate(prompt, do_sample=False, max_new_tokens=33, eos_token_id=None, assistant_model=oracle)
    assert torch.equal(output, free[:, : prompt.shape[1] + 33])
    assert oracle.last_acceptance.block_sizes == [8, 8, 8, 8]

    drafter = make_drafter(target, block_size=8)
    drafter.block_size_policy = AdaptiveBlockSize(cost_model=cost_model)
    output = target.generate(prompt, do_sample=False, max_new_tokens=40, eos_token_id=None, assistant_model=drafter)
    assert torch.equal(output, free)
    sizes = drafter.last_acceptance.block_sizes
    assert sizes[0] == 8 and max(sizes[8:]) <= 2, sizes  # optimistic start, then (almost) plain decoding


def test_adaptive_policy_in_batched_generation():
    target, input_ids, attention_mask, free = free_batch("qwen2")
    kwargs = dict(
        attention_mask=attention_mask, do_sample=False, max_new_tokens=36, eos_token_id=None, pad_token_id=PAD
    )
    drafter = make_drafter(target, block_size=8)
    drafter.block_size_policy = AdaptiveBlockSize(cost_model=CostModel.from_function(LINEAR_COST, 8))
    assert torch.equal(target.generate(input_ids, assistant_model=drafter, **kwargs), free)
    sizes = drafter.last_acceptance.block_sizes
    assert sizes[0] == 8 and max(sizes[8:]) <= 2, sizes


def test_adaptive_with_measured_cost_model(tmp_path, monkeypatch):
    """ "adaptive" measures the real models once and caches the result under $HF_DFLASH_CACHE."""
    monkeypatch.setenv("HF_DFLASH_CACHE", str(tmp_path))
    target, prompt, free = free_run("qwen3")
    drafter = make_drafter(target, block_size=4)
    drafter.block_size_policy = "adaptive"
    output = target.generate(prompt, do_sample=False, max_new_tokens=12, eos_token_id=None, assistant_model=drafter)
    assert torch.equal(output, free[:, : prompt.shape[1] + 12])
    files = list((tmp_path / "cost_models").glob("*.json"))
    assert len(files) == 1 and set(json.loads(files[0].read_text())["seconds"]) == {"1"}


@torch.no_grad()
def test_sampling_with_random_schedule_preserves_target_distribution():
    """do_sample, batched, a random block length every round: the 2nd new token of 48 copies of a prompt
    follows its exact marginal (chi-square helper of test_generation_sampling)."""
    from tests.helpers.generation import ALPHA, chi_square_against, second_token_marginal

    warpers = dict(temperature=0.8, top_k=40, top_p=0.95)
    target = make_target("qwen3", seed=3)
    drafter = make_drafter(target, block_size=4, seed=4)
    drafter.block_size_policy = random_schedule(4, seed=0)
    prefix = torch.tensor([[5, 17, 33, 9, 71]])
    p_second = second_token_marginal(target, prefix, **warpers)
    torch.manual_seed(0)
    counts = torch.zeros_like(p_second)
    for _ in range(25):
        out = target.generate(
            prefix.repeat(48, 1),
            do_sample=True,
            max_new_tokens=3,
            assistant_model=drafter,
            eos_token_id=None,
            pad_token_id=PAD,
            **warpers,
        )
        counts += torch.bincount(out[:, prefix.shape[1] + 1], minlength=len(counts)).float()
    assert chi_square_against(counts, p_second, "random schedule generate(do_sample)").pvalue > ALPHA


def test_single_prompt_sampling_with_random_schedule_runs_every_block_length():
    """Smoke test of batch-1 sampling under a random schedule (rounds without drafts sample the target
    directly); the distribution checks are the batched test above and test_generation_sampling."""
    target = make_target("llama")
    drafter = make_drafter(target, block_size=5)
    drafter.block_size_policy = random_schedule(5, seed=1)
    torch.manual_seed(0)
    out = target.generate(
        torch.tensor([[5, 6, 7]]),
        do_sample=True,
        max_new_tokens=40,
        eos_token_id=None,
        assistant_model=drafter,
        temperature=0.8,
    )
    assert out.shape == (1, 43)
    check_stats(drafter.last_acceptance, 5)
    assert set(drafter.last_acceptance.block_sizes) == {1, 2, 3, 4, 5}


def test_command_line_policies_parse_and_bad_ones_name_the_fix():
    assert parse_block_size_policy("recommended", 16) is None
    assert parse_block_size_policy("trained", 16) == 16
    assert parse_block_size_policy("adaptive", 16) == "adaptive"
    assert parse_block_size_policy("8", 16) == 8 and parse_block_size_policy("1", 16) == 1
    for bad in ("17", "0", "-3", "fast", "8.0"):
        with pytest.raises(ValueError, match=r"'recommended'.*'trained'.*'adaptive'.*1 <= k <= 16"):
            parse_block_size_policy(bad, 16)


def test_a_drafter_config_carries_a_recommended_policy(tmp_path):
    """config.block_size_policy is the default; drafter.block_size_policy overrides it; both survive saving."""
    target = make_target("llama")
    drafter = make_drafter(target, block_size=6, block_size_policy=3)
    drafter.save_pretrained(tmp_path / "drafter")
    loaded = type(drafter).from_pretrained(tmp_path / "drafter")
    assert loaded.config.block_size_policy == 3
    prompt = torch.tensor([[5, 17, 33, 9]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=12, eos_token_id=None)
    assert torch.equal(
        target.generate(prompt, do_sample=False, max_new_tokens=12, eos_token_id=None, assistant_model=loaded), plain
    )
    assert set(loaded.last_acceptance.block_sizes[:-1]) == {3}
    loaded.block_size_policy = 6  # the user's setting wins
    target.generate(prompt, do_sample=False, max_new_tokens=12, eos_token_id=None, assistant_model=loaded)
    assert loaded.last_acceptance.block_sizes[0] == 6


@pytest.mark.parametrize("bad", [1, 7, "fast", 2.0, True])
def test_a_bad_recommended_policy_is_named(bad):
    with pytest.raises(ValueError, match=f"block_size_policy={bad!r} must be None"):
        make_drafter(make_target("llama"), block_size=6, block_size_policy=bad)


def test_calibrated_seconds_substitute_measured_rounds_and_scale_the_drafting_ones():
    from hf_dflash.generation.policies.block_size import calibrated_seconds

    modelled = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    assert torch.equal(calibrated_seconds(modelled, {}), modelled)
    calibrated = calibrated_seconds(modelled, {3: 6.0})  # the 3-token round took twice what the model said
    assert calibrated.tolist() == [1.0, 4.0, 6.0, 8.0]  # a plain step stays as modelled until timed
    assert modelled.tolist() == [1.0, 2.0, 3.0, 4.0]  # the model itself is untouched
    assert calibrated_seconds(modelled, {1: 3.0, 2: 6.0, 4: 4.0}).tolist() == [3.0, 6.0, 6.0, 4.0]  # ratio (3 + 1) / 2


def timed_choices(monkeypatch, cost: CostModel, drafting_seconds: float, accepted, rounds: int = 6) -> list[int]:
    """The block lengths a calibrating controller (B = 4) chooses over `rounds` rounds when a drafting round takes
    `drafting_seconds` and a plain step 1 s (a fake clock), with `accepted(k)` drafts accepted at block length k."""
    import hf_dflash.generation.policies.block_size as adaptive

    controller = adaptive.AdaptiveController(adaptive.AdaptiveBlockSize(), 4, 1, cost, calibrate=True)
    now = [0.0]

    def clock():
        if controller.pending is not None:
            now[0] += drafting_seconds if controller.pending[1] > 1 else 1.0
        return now[0]

    monkeypatch.setattr(adaptive.time, "perf_counter", clock)
    chosen = []
    for _ in range(rounds):
        chosen.append(controller.choose([0]))
        controller.observe([0], chosen[-1] - 1, torch.tensor([accepted(chosen[-1])]))
    return chosen


def test_timed_rounds_fall_back_to_plain_steps_where_drafting_does_not_pay(monkeypatch):
    import hf_dflash.generation.policies.block_size as adaptive

    cost = CostModel.from_function(lambda k: 1.0 + 0.01 * k, 4)  # drafting looks nearly free
    chosen = timed_choices(monkeypatch, cost, 5.0, lambda k: 1 if k > 1 else 0)  # one draft accepted, in 5 s
    assert chosen[0] == 4  # optimistic prior, modelled costs
    assert chosen[-3:] == [1, 1, 1]  # 2 tokens per 5 s lose to 1 token per second
    uncalibrated = adaptive.AdaptiveController(adaptive.AdaptiveBlockSize(), 4, 1, cost)
    assert [uncalibrated.choose([0]) for _ in range(3)] == [4, 4, 4] and uncalibrated.measured == {}


def test_a_model_that_overprices_drafting_is_corrected_by_one_timed_block(monkeypatch):
    """A measured cost model can be wrong (timed while something else ran): one pricing drafting rounds 20x
    dearer than plain steps would choose plain steps from the first round and never time a drafting round to
    correct itself. Until a drafting round is timed, the calibrating controller drafts whole blocks."""
    import hf_dflash.generation.policies.block_size as adaptive

    cost = CostModel.from_function(lambda k: 1.0 if k == 1 else 20.0, 4)  # drafting priced at 20 s a round
    chosen = timed_choices(monkeypatch, cost, 2.0, lambda k: k - 1)  # every draft accepted, in 2 s
    assert chosen == [4] * 6  # 4 tokens per 2 s beat 1 per second once a block was timed
    uncorrected = adaptive.AdaptiveController(adaptive.AdaptiveBlockSize(), 4, 1, cost)  # a given model: as given
    assert uncorrected.choose([0]) == 1
