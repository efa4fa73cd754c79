"""The "confidence" policy (`hf_dflash.generation.policies.confidence`): the prefix choice by hand, its calibration, and
losslessness whatever prefix is verified (greedy single and batched, DFlash and DFlash2, Transformers' loop with our
generator, compiled verification, sampling)."""

import pytest
import torch

from hf_dflash.generation.policies.confidence import (
    ConfidentPrefix,
    DraftCalibration,
    PrefixController,
    best_prefix,
    reach_probabilities,
)
from hf_dflash.generation.policies.cost_model import CostModel
from tests.conftest import VOCAB, OracleDrafter, make_drafter, make_target
from tests.helpers.compiled import compiled_dflash
from tests.helpers.generation import PAD, check_sampled_second_token, random_batch
from tests.test_dflash2_serving import dflash2_drafter

FLAT_COST = lambda k: 1.0  # noqa: E731  (every round costs the same: verify every draft)
STEEP_COST = lambda n: 1.0 + 0.5 * (n - 1)  # noqa: E731  (one more token costs half a step)


# --- the choice, by hand ---


def test_reach_is_the_product_of_the_drafts_probabilities():
    reach = reach_probabilities(torch.tensor([[0.5, 0.5, 0.2], [1.0, 0.1, 1.0]]))
    torch.testing.assert_close(reach, torch.tensor([[0.5, 0.25, 0.05], [1.0, 0.1, 0.1]], dtype=torch.float64))


def test_best_prefix_weighs_expected_tokens_against_the_cost_of_verifying_them():
    seconds = torch.tensor([1.0, 1.5, 2.0, 2.5])  # a forward over 1..4 tokens
    sure = reach_probabilities(torch.tensor([[0.99, 0.99, 0.99]]))
    assert best_prefix(sure, seconds) == 3  # 3.94 tokens / 2.5 s beats 1 / 1
    unsure = reach_probabilities(torch.tensor([[0.3, 0.9, 0.9]]))
    assert best_prefix(unsure, seconds) == 0  # 1.3 / 1.5 < 1 / 1: a plain step
    first_only = reach_probabilities(torch.tensor([[0.9, 0.2, 0.9]]))
    assert best_prefix(first_only, seconds) == 1  # 1.9 / 1.5 against 2.08 / 2.0 and 1 / 1
    assert best_prefix(first_only, seconds, calibration=0.5) == 0  # the drafter proved overconfident
    assert best_prefix(sure, seconds, choices=(0, 3)) == 3 and best_prefix(unsure, seconds, choices=(0, 3)) == 0


def test_best_prefix_sums_the_rows_and_takes_the_fewest_drafts_on_ties():
    seconds = torch.tensor([1.0, 2.0, 3.0])
    rows = reach_probabilities(torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    assert best_prefix(rows, seconds) == 0  # 2 rows: 2 / 1 against 3 / 2 and 4 / 3
    assert best_prefix(reach_probabilities(torch.tensor([[1.0, 1.0]])), torch.tensor([1.0, 2.0, 3.0])) == 0  # ties


def test_calibration_learns_how_far_to_trust_the_drafter():
    calibration = DraftCalibration()
    assert calibration.factor == 1.0
    for _ in range(20):  # the drafter expects 2 accepted drafts a round; the target keeps 1
        calibration.expected = 2.0
        calibration.observe(1.0)
    assert 0.5 < calibration.factor < 0.56


def test_under_compiled_verification_all_drafts_or_none():
    controller = ConfidentPrefix(cost_model=CostModel.from_function(FLAT_COST, 4, STEEP_COST)).start(
        None, make_drafter(make_target("llama"), block_size=4), 1, fixed_verification=True
    )
    assert isinstance(controller, PrefixController) and controller.choose([0]) == 4
    assert controller.prefix(torch.tensor([[0.9, 0.2, 0.9]])) in (0, 3)
    assert controller.prefix(torch.tensor([[0.01, 0.5, 0.5]])) == 0
    # two drafts left (the end of the output) still cost the padded width: 2.44 tokens for 2.5 s lose to a step
    assert controller.prefix(torch.tensor([[0.8, 0.8]])) == 0
    eager = ConfidentPrefix(cost_model=CostModel.from_function(FLAT_COST, 4, STEEP_COST)).start(
        None, make_drafter(make_target("llama"), block_size=4), 1
    )
    assert eager.prefix(torch.tensor([[0.8, 0.8]])) == 2  # 2.44 tokens for 2 s
    with pytest.raises(ValueError, match="decay"):
        ConfidentPrefix(decay=0)


def test_plain_steps_without_a_drafter_pass_while_drafting_does_not_pay():
    from hf_dflash.generation.policies.confidence import PROBE_EVERY

    # verifying n tokens costs 1 + 0.5 (n - 1); the drafter's pass 0.3 (a round of k: its pass + verifying k)
    cost = CostModel.from_function(lambda k: 1.3 + 0.5 * (k - 1), 4, STEEP_COST)
    controller = ConfidentPrefix(cost_model=cost).start(None, make_drafter(make_target("llama"), block_size=4), 1)
    assert controller.choose([0]) == 4
    assert controller.prefix(torch.tensor([[0.01, 0.01, 0.01]])) == 0  # 1 token for 1.3 s against 1 for 1
    assert [controller.choose([0]) for _ in range(PROBE_EVERY)] == [1] * (PROBE_EVERY - 1) + [4]  # then a probe
    controller.prefix(torch.tensor([[0.99, 0.99, 0.99]]))  # 3.9 tokens for 2.8 s: drafting pays again
    assert controller.choose([0]) == 4 and controller.drafting_gain(1) > 0  # weighed when the round ends


def timed_confident_choices(
    monkeypatch, cost: CostModel, drafted_seconds: float, calibrate: bool, plain_seconds=1.0, sure=0.9, accepted=None
) -> list[int]:
    """The block lengths a controller (B = 4) chooses over 12 rounds when a drafted round takes `drafted_seconds`
    and a plain step `plain_seconds` (a fake clock), the drafter `sure` of each draft and `accepted` drafts
    accepted (None: all)."""
    import hf_dflash.generation.policies.confidence as confidence

    controller = PrefixController(4, cost, False, DraftCalibration(), calibrate=calibrate)
    now = [0.0]

    def clock():
        if controller.pending is not None:
            now[0] += plain_seconds if controller.pending[1] is None else drafted_seconds
        return now[0]

    monkeypatch.setattr(confidence.time, "perf_counter", clock)
    chosen = []
    for _ in range(12):
        chosen.append(controller.choose([0]))
        if chosen[-1] > 1:
            drafts = controller.prefix(torch.full((1, 3), sure))
            controller.observe([0], drafts, torch.tensor([drafts if accepted is None else min(accepted, drafts)]))
    return chosen


def test_timed_rounds_correct_a_cost_model_that_overprices_drafting(monkeypatch):
    """A cost model timed while something else ran may price the drafter's pass far above its cost (here 3 s, where
    a whole drafted round takes 1.8 s and a plain step 1 s): the drafter's 3.4 expected tokens would lose to plain
    steps, drafted again only to probe. The calibrating controller (a measured cost model) times each round from one
    choice to the next, and weighs drafting by what its drafted rounds took against their modelled prices."""
    verify = lambda n: 1.0 + 0.1 * (n - 1)  # noqa: E731
    overpriced = CostModel.from_function(lambda k: 1.0 if k == 1 else 3.0 + verify(k), 4, verify)
    assert timed_confident_choices(monkeypatch, overpriced, 1.8, calibrate=True) == [4] * 12
    assert timed_confident_choices(monkeypatch, overpriced, 1.8, calibrate=False)[:3] == [4, 1, 1]  # as given


def test_timed_rounds_fall_back_to_plain_steps_where_drafting_does_not_pay(monkeypatch):
    underpriced = CostModel.from_function(lambda k: 1.0 if k == 1 else 1.2, 4, lambda n: 1.0 if n == 1 else 1.1)
    assert timed_confident_choices(monkeypatch, underpriced, 1.2, calibrate=True) == [4] * 12
    chosen = timed_confident_choices(monkeypatch, underpriced, 8.0, calibrate=True)  # 4 tokens in 8 s
    assert chosen[:3] == [4, 1, 1] and chosen.count(4) == 2  # one probe in the 11 rounds after the first


def test_a_long_prompt_reprices_the_plain_step_once_one_is_timed(monkeypatch):
    """A cost model timed after a short context: verifying costs 1 s, the drafter's pass 0.3 s. After a long prompt
    every forward takes twice that: a drafted round 2.6 s for 2 tokens (one draft accepted), a plain step 2 s, so
    drafting pays (0.77 vs 0.5 tokens/s). Weighed against the modelled 1 s step, the first round looks a loss and a
    plain step follows; its 2 s re-prices that round, and the rounds draft again instead of probing every 8th."""
    cost = CostModel.from_function(lambda k: 1.0 if k == 1 else 1.3, 4, FLAT_COST)
    chosen = timed_confident_choices(monkeypatch, cost, 2.6, calibrate=True, plain_seconds=2.0, sure=0.3, accepted=1)
    assert chosen[:3] == [4, 1, 4] and chosen.count(1) == 1


def test_a_measured_cost_model_is_calibrated_and_a_given_one_is_not(monkeypatch):
    import hf_dflash.generation.policies.confidence as confidence

    drafter = make_drafter(make_target("llama"), block_size=4)
    cost = CostModel.from_function(FLAT_COST, 4, STEEP_COST)
    assert not ConfidentPrefix(cost_model=cost).start(None, drafter, 1).calibrate
    monkeypatch.setattr(confidence, "measured_cost_model", lambda *args, **kwargs: cost)
    assert ConfidentPrefix().start(None, drafter, 1).calibrate


def test_trees_and_the_hybrid_budget_size_their_own_drafts():
    """A chain's confident prefix is no policy for strategies that size their drafts themselves: a drafter tree's
    block and the hybrid budget run the adaptive block size under it."""
    from hf_dflash.generation.policies.block_size import AdaptiveController, block_size_controller
    from hf_dflash.generation.policies.hybrid_budget import tree_budget

    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    cost = CostModel.from_function(FLAT_COST, 4, STEEP_COST)
    drafter.block_size_policy = ConfidentPrefix(cost_model=cost)
    assert isinstance(block_size_controller(drafter, target, 1), PrefixController)
    assert isinstance(block_size_controller(drafter, target, 1, trees=True), AdaptiveController)
    budget = tree_budget(drafter, target, max_ngram_tokens=4, one_branch=False)
    assert budget.block is None and budget.cost_model is cost  # the adaptive budget over the policy's cost model


def test_a_prefix_of_drafts_keeps_its_scores_and_probabilities():
    from hf_dflash.generation.drafting.block_drafter import Drafts

    drafts = Drafts(torch.arange(6).view(2, 3), torch.rand(2, 3, 5), torch.rand(2, 3))
    prefix = drafts.prefix(1)
    assert torch.equal(prefix.tokens, drafts.tokens[:, :1]) and torch.equal(prefix.scores, drafts.scores[:, :1])
    assert torch.equal(prefix.probabilities, drafts.probabilities[:, :1])
    assert Drafts(drafts.tokens).prefix(0).scores is None and Drafts(drafts.tokens).prefix(0).tokens.shape == (2, 0)


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_a_sampled_draft_is_priced_by_the_chance_two_draws_agree(kind):
    """Under sampling a draft x ~ q is accepted with min(1, p(x)/q(x)), unknown before the target verifies it. Its
    price is sum_v q_v^2 (q(x) averaged over the draws): the draw's own q(x) fell short of it on held-out sampled
    chats (benchmarks/generation/sampling_confidence.py), and two draws of one round get one price."""
    from transformers import LogitsProcessorList
    from transformers.generation.logits_process import TemperatureLogitsWarper

    from hf_dflash.generation.drafting.block_drafter import BlockDrafter

    target = make_target("qwen3", seed=3)
    drafter = dflash2_drafter(target) if kind == "dflash2" else make_drafter(target, block_size=4, seed=4)
    block = BlockDrafter(drafter, target)
    hidden = torch.randn(2, drafter.config.block_size - 1, drafter.config.hidden_size)
    processors = LogitsProcessorList([TemperatureLogitsWarper(50.0)])  # flat enough that two draws differ
    prefixes, anchors = [torch.tensor([1, 2]), torch.tensor([3])], torch.tensor([5, 9])
    draws = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        draws.append(block.draft(hidden, True, processors, 2, [0, 1], prefixes, anchors, confidence=True))
    assert not torch.equal(draws[0].tokens, draws[1].tokens)
    for drafts in draws:
        torch.testing.assert_close(drafts.probabilities, drafts.scores.square().sum(-1))
    torch.testing.assert_close(draws[0].probabilities[:, 0], draws[1].probabilities[:, 0])


# --- lossless whatever is verified ---


@pytest.fixture
def prefixes(monkeypatch):
    """The number of drafts every round of the "confidence" policy verified."""
    chosen = []
    original = PrefixController.prefix

    def spy(self, draft_probabilities):
        chosen.append((original(self, draft_probabilities), draft_probabilities.shape[1]))
        return chosen[-1][0]

    monkeypatch.setattr(PrefixController, "prefix", spy)
    return chosen


def free_run(target, max_new_tokens: int = 40):
    prompt = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(5))
    return prompt, target.generate(prompt, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None)


@pytest.mark.parametrize(
    "kind, per_token, verified",
    [
        ("dflash", 0.5, "none"),  # a random drafter (q ~ 1 / vocab) where a token costs half a step: plain steps
        ("dflash", 0.005, "first"),  # ... where it costs 0.005: the first draft (q ~ 0.01) pays, the second not
        ("dflash2", 0.02, "all"),  # a DFlash2 selector far from identity is sure of its walk: whole blocks
    ],
)
def test_greedy_equals_plain_greedy_with_any_prefix(kind, per_token, verified, prefixes):
    target = make_target("qwen3")
    prompt, free = free_run(target)
    drafter = make_drafter(target, block_size=6) if kind == "dflash" else dflash2_drafter(target, block_size=6)
    cost = CostModel.from_function(FLAT_COST, 6, lambda n: 1 + per_token * (n - 1))
    drafter.block_size_policy = ConfidentPrefix(cost_model=cost)
    output = target.generate(prompt, do_sample=False, max_new_tokens=40, eos_token_id=None, assistant_model=drafter)
    assert torch.equal(output, free)
    chosen = [m for m, _ in prefixes]
    expected = {"none": lambda m, d: m == 0, "first": lambda m, d: m == 1, "all": lambda m, d: m == d}[verified]
    assert sum(expected(m, d) for m, d in prefixes) >= 0.8 * len(prefixes), chosen
    assert set(drafter.last_acceptance.block_sizes) <= {1, 6}


def test_an_oracle_drafter_is_verified_whole_and_accepted():
    target = make_target("llama")
    prompt, free = free_run(target, 33)
    oracle = OracleDrafter(
        make_drafter(target, block_size=8).config, target.get_output_embeddings().weight, free
    ).eval()
    oracle.block_size_policy = ConfidentPrefix(cost_model=CostModel.from_function(FLAT_COST, 8, STEEP_COST))
    output = target.generate(prompt, do_sample=False, max_new_tokens=33, eos_token_id=None, assistant_model=oracle)
    assert torch.equal(output, free[:, : prompt.shape[1] + 33])
    assert oracle.last_acceptance.acceptance_lengths == [8, 8, 8, 8]


def test_batched_greedy_equals_plain_greedy(prefixes):
    target = make_target("qwen2")
    input_ids, attention_mask = random_batch(torch.Generator().manual_seed(2), 4)
    kwargs = dict(
        attention_mask=attention_mask, do_sample=False, max_new_tokens=30, eos_token_id=None, pad_token_id=PAD
    )
    free = target.generate(input_ids, **kwargs)
    drafter = make_drafter(target, block_size=5)
    drafter.block_size_policy = ConfidentPrefix(
        cost_model=CostModel.from_function(FLAT_COST, 5, lambda n: 1 + 0.05 * n)
    )
    assert torch.equal(target.generate(input_ids, assistant_model=drafter, **kwargs), free)
    assert prefixes and all(0 <= m <= drafts for m, drafts in prefixes)


def test_transformers_loop_with_our_generator(prefixes, monkeypatch):
    """Transformers' own assisted loop with our candidate generator under the policy: plain greedy, every round's
    drafts counted as verified (the prefix), not as drafted."""
    from transformers.generation.utils import GenerationMixin

    from hf_dflash import DFlashCandidateGenerator

    target = make_target("qwen3")
    prompt, free = free_run(target, 30)
    drafter = make_drafter(target, block_size=5)
    policy = ConfidentPrefix(cost_model=CostModel.from_function(FLAT_COST, 5, lambda n: 1 + 0.005 * (n - 1)))
    made = []

    def candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs, **kw):
        controller = policy.start(target, drafter, 1)
        made.append(DFlashCandidateGenerator(drafter, self, generation_config, logits_processor, controller))
        return made[-1]

    monkeypatch.setattr(GenerationMixin, "_get_candidate_generator", candidate_generator)
    kwargs = dict(do_sample=False, max_new_tokens=30, eos_token_id=None)
    output = target.generate(prompt, assistant_model=drafter, speculation_type="dflash", **kwargs)
    assert torch.equal(output, free[:, : prompt.shape[1] + 30])
    assert prefixes and all(m == 1 for m, _ in prefixes), prefixes  # q ~ 0.01: the first draft pays, no more
    assert made[0].stats.acceptance_lengths and max(made[0].stats.acceptance_lengths) <= 2


def test_compiled_verification_verifies_all_drafts_or_takes_a_plain_step(prefixes):
    target = make_target("llama")
    prompt, free = free_run(target, 24)
    drafter = make_drafter(target, block_size=4)
    drafter.block_size_policy = ConfidentPrefix(
        cost_model=CostModel.from_function(FLAT_COST, 4, lambda n: 1 + 0.05 * n)
    )
    assert torch.equal(compiled_dflash(target, drafter, prompt, 24), free[:, : prompt.shape[1] + 24])
    assert prefixes and all(m in (0, drafts) for m, drafts in prefixes)


def test_the_policy_by_name_measures_the_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DFLASH_CACHE", str(tmp_path))
    target = make_target("qwen3")
    prompt, free = free_run(target, 12)
    drafter = make_drafter(target, block_size=4)
    drafter.block_size_policy = "confidence"
    output = target.generate(prompt, do_sample=False, max_new_tokens=12, eos_token_id=None, assistant_model=drafter)
    assert torch.equal(output, free[:, : prompt.shape[1] + 12])
    assert list((tmp_path / "cost_models").glob("*.json"))


def test_sampling_keeps_the_target_distribution(prefixes):
    target = make_target("qwen3", seed=3)
    drafter = make_drafter(target, block_size=4, seed=4)
    drafter.block_size_policy = ConfidentPrefix(
        cost_model=CostModel.from_function(FLAT_COST, 4, lambda n: 1 + 0.02 * (n - 1))
    )
    check_sampled_second_token(target, drafter, "confidence prefix", draws=600)
    assert any(m > 0 for m, _ in prefixes)  # drafts verified (and, the helper checks, accepted)
