"""Gemma 3 served correctly (issue 35): sliding-window layers next to full-attention layers.

Sliding layers are where speculative decoding goes silently wrong: the target's verification and the drafter's
context must see exactly the keys plain decoding sees, and rolling back rejected drafts must not lose keys a
sliding layer already evicted. So every mode runs on contexts SHORTER than the window and LONGER than it (the
prompt alone, or the prompt plus the generation), and greedy DFlash == plain greedy token for token (fp32):
chains (random, always-right and partly-right drafters), drafter trees, hybrid drafting, left-padded batches,
compiled verification over a static cache, and sampling (chi-square). Tiny random Gemma 3 (vocab 128, hidden 32,
window 8 or 64), then the real Gemma 3 270M (window 512, `real_model`).

What the loop refuses on purpose with a window that generation can reach (tested as refusals, with the reason):
batched DFlash (a ValueError naming the window), draft trees and the tree of hybrid drafting (chains / one
branch, with a warning), a static cache longer than the window (its sliding layers cannot roll back).
"""

import importlib.util
import time
import warnings

import pytest
import torch
from transformers import CompileConfig, Gemma3ForCausalLM, Gemma3TextConfig
from transformers.cache_utils import DynamicSlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer
from transformers.modeling_outputs import BaseModelOutputWithPast

from hf_dflash import DFlashConfig, DFlashDraftModel
from hf_dflash.bench.methods import generate_with
from hf_dflash.caches import cache_keyword
from hf_dflash.generation.decoding import CACHE_FIELD
from hf_dflash.generation.drafting.block_drafter import BlockDrafter
from hf_dflash.generation.verifying.compiling import compiled_generate_kwargs
from hf_dflash.targets import CACHE_ENV_VAR, KNOWN_TARGETS, load_target
from tests.conftest import COMMON, VOCAB, OracleDrafter, make_drafter
from tests.helpers.generation import (
    ALPHA,
    PAD,
    chi_square_against,
    eos_mid_way,
    oracle_for,
    plain_greedy,
    prompt,
    random_batch,
    record_drafter_calls,
    reference_features,
    second_token_marginal,
)
from tests.helpers.hybrid import prompt as repeating_prompt

GREEDY = dict(do_sample=False, eos_token_id=None)
BEYOND, WITHIN = 8, 64  # sliding windows: contexts run past the first, never reach the second
# Two sliding layers, then a global one (Gemma 3 itself: five, then one); the drafter reads layers [1, 3].
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2
# name: (sliding window, prompt length, new tokens)
CONTEXTS = {
    "within-window": (WITHIN, 5, 12),
    "within-small-window": (BEYOND, 3, 4),  # 7 tokens < 8: nothing is ever evicted
    "generation-beyond-window": (BEYOND, 5, 30),  # 35 tokens: rounds verify and roll back past evicted keys
    "prompt-beyond-window": (BEYOND, 12, 20),  # the prefill already evicts
}
SHORT, LONG = "within-window", "generation-beyond-window"


def make_gemma3(sliding_window: int = BEYOND, seed: int = 0, attn: str | None = None) -> Gemma3ForCausalLM:
    """A tiny random Gemma 3 text model in fp32 eval mode (same weights for every window with one seed)."""
    config = Gemma3TextConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=sliding_window,
        layer_types=LAYER_TYPES,
    )  # fmt: skip
    if attn is not None:
        config._attn_implementation = attn
    torch.manual_seed(seed)
    return Gemma3ForCausalLM(config).eval()


def context(name: str, seed: int = 0, **target_kwargs):
    """(target, prompt, max_new_tokens) of a CONTEXTS case."""
    window, length, new = CONTEXTS[name]
    return make_gemma3(window, **target_kwargs), prompt(seed, length=length), new


def noisy_oracle(target, input_ids, block_size: int, max_new_tokens: int, noise: float = 0.3, seed: int = 0):
    """An oracle drafter for the target's greedy continuation with a fraction `noise` of its tokens wrong: rounds
    accept partial blocks, so every round rolls back some drafts (past evicted keys, beyond the window)."""
    greedy = plain_greedy(target, input_ids, max_new_tokens=max_new_tokens + block_size, eos_token_id=None)
    generator = torch.Generator().manual_seed(seed)
    wrong = torch.rand(greedy.shape, generator=generator) < noise
    shift = torch.randint(1, VOCAB, greedy.shape, generator=generator)
    greedy = torch.where(wrong, (greedy + shift) % VOCAB, greedy)
    config = make_drafter(target, block_size=block_size).config
    return OracleDrafter(config, target.get_output_embeddings().weight, greedy).eval()


def matches_plain_greedy(target, drafter, input_ids, max_new_tokens: int, **kwargs) -> torch.LongTensor:
    expected = plain_greedy(target, input_ids, max_new_tokens=max_new_tokens, eos_token_id=None)
    actual = target.generate(input_ids, max_new_tokens=max_new_tokens, assistant_model=drafter, **GREEDY, **kwargs)
    assert torch.equal(actual, expected)
    return actual


def reaches_the_window(target, max_length: int, nodes: int = 0) -> bool:
    """Whether generation can reach the sliding window (`options.reachable_slots`: max_length + a round)."""
    return target.config.sliding_window <= max_length + nodes


# --- the tiny model and its drafter ---


def test_the_window_changes_plain_greedy_so_the_checks_can_see_it():
    """Sanity of every check below: with window 8 the tiny target's greedy output differs from the same weights
    with a window that is never reached, so a loop that kept evicted keys (or lost kept ones) would diverge."""
    input_ids = prompt(1, length=5)
    small = plain_greedy(make_gemma3(BEYOND), input_ids, max_new_tokens=30, eos_token_id=None)
    large = plain_greedy(make_gemma3(WITHIN), input_ids, max_new_tokens=30, eos_token_id=None)
    assert not torch.equal(small, large)
    # identical until the window first evicts: position 9 is predicted at position 8, which sees 1..8
    assert torch.equal(small[:, : BEYOND + 1], large[:, : BEYOND + 1])


def test_drafter_config_from_gemma3_config():
    """`DFlashConfig.from_target_config` on Gemma 3: explicit head_dim, GQA, the global layers' RoPE (per-layer-type
    RoPE), full-attention drafter layers; the drafter embeds with the target's scaled embedding (x sqrt(hidden))."""
    target = make_gemma3()
    drafter = make_drafter(target, block_size=4)
    config = drafter.config
    assert config.hidden_size == 32 and config.head_dim == 16
    assert config.num_attention_heads == 4 and config.num_key_value_heads == 2
    assert config.rope_parameters["rope_theta"] == target.config.rope_parameters["full_attention"]["rope_theta"]
    assert set(config.layer_types) == {"full_attention"}
    assert config.target_layer_ids == [1, 3] and config.num_target_layers == 6 and 0 <= config.mask_token_id < VOCAB
    ids = torch.tensor([[5, 17, 33]])
    embedded = BlockDrafter(drafter, target).embedding(ids)
    torch.testing.assert_close(embedded, target.get_input_embeddings().weight[ids] * 32**0.5)
    matches_plain_greedy(target, drafter, prompt(0, length=5), 12)


# --- chains ---


@pytest.mark.parametrize("name", sorted(CONTEXTS))
@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_random_drafter_chains_match_plain_greedy(name, block_size):
    target, input_ids, new = context(name)
    drafter = make_drafter(target, block_size=block_size)
    matches_plain_greedy(target, drafter, input_ids, new)
    assert 1 in drafter.last_acceptance.acceptance_lengths  # rejections: the cache was rolled back


@pytest.mark.parametrize("name", [SHORT, LONG, "prompt-beyond-window"])
@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_oracle_drafter_chains_match_and_accept_whole_blocks(name, block_size):
    target, input_ids, new = context(name)
    drafter = oracle_for(target, input_ids, block_size, new)
    matches_plain_greedy(target, drafter, input_ids, new)
    lengths = drafter.last_acceptance.acceptance_lengths
    assert sum(lengths) + 1 == new and all(length == block_size for length in lengths[:-1])


@pytest.mark.parametrize("name", [SHORT, LONG, "prompt-beyond-window"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_partly_right_drafter_rolls_back_partial_blocks(name, attn):
    """Rounds accept part of their block: each one rolls back the rest, past keys a sliding layer evicted."""
    target, input_ids, new = context(name, attn=attn)
    drafter = noisy_oracle(target, input_ids, 6, new)
    matches_plain_greedy(target, drafter, input_ids, new)
    lengths = drafter.last_acceptance.acceptance_lengths
    assert any(1 < length < 6 for length in lengths)  # partial blocks, not only all-or-nothing


def test_drafter_context_and_target_cache_hold_exactly_plain_decodings_keys():
    """Beyond the window, with partial blocks rolled back every round: the drafter received, position by
    position, the target features of one plain forward over the output; the target cache ends holding plain
    decoding's keys (full layers: all of them; sliding layers: the window's last W - 1, at the same length)."""
    target, input_ids, new = context(LONG)
    drafter = noisy_oracle(target, input_ids, 5, new, seed=1)
    calls, handle = record_drafter_calls(drafter)
    kwargs = dict(max_new_tokens=new, return_dict_in_generate=True, **GREEDY)
    try:
        actual = target.generate(input_ids, assistant_model=drafter, **kwargs)
    finally:
        handle.remove()
    expected = target.generate(input_ids, **kwargs)
    assert torch.equal(actual.sequences, expected.sequences)
    positions, features = [], []
    for call in calls:
        width = call["context_hidden_states"].shape[1]
        positions += call["position_ids"][0, :width].tolist()
        features.append(call["context_hidden_states"][0])
    assert positions == list(range(len(positions))) and len(positions) > 2 * BEYOND
    reference = reference_features(target, drafter, actual.sequences[0])[: len(positions)]
    torch.testing.assert_close(torch.cat(features), reference, rtol=1e-4, atol=1e-4)
    mine, plain = getattr(actual, CACHE_FIELD), getattr(expected, CACHE_FIELD)
    assert mine.get_seq_length() == plain.get_seq_length() == actual.sequences.shape[1] - 1
    for ours, theirs in zip(mine.layers, plain.layers):
        assert type(ours) is type(theirs)
        assert ours.get_seq_length() == theirs.get_seq_length()
        keep = BEYOND - 1 if isinstance(theirs, DynamicSlidingWindowLayer) else theirs.keys.shape[2]
        assert theirs.keys.shape[2] == keep
        torch.testing.assert_close(ours.keys[:, :, -keep:], theirs.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ours.values[:, :, -keep:], theirs.values, rtol=1e-4, atol=1e-4)


def test_sliding_layers_stay_within_their_window_when_whole_blocks_are_accepted():
    target, input_ids, new = context(LONG)
    drafter = oracle_for(target, input_ids, 4, new)  # every draft accepted: no round rolls anything back
    output = target.generate(
        input_ids, max_new_tokens=new, assistant_model=drafter, return_dict_in_generate=True, **GREEDY
    )
    assert output.sequences.shape[1] == input_ids.shape[1] + new
    cache = getattr(output, CACHE_FIELD)
    sliding = [layer.keys.shape[2] for layer in cache.layers if isinstance(layer, DynamicSlidingWindowLayer)]
    assert sliding and max(sliding) <= BEYOND - 1 + 4  # plain decoding: W - 1; a round's tokens at most on top


# --- drafter trees ---


@pytest.mark.parametrize("name", sorted(CONTEXTS))
@pytest.mark.parametrize("oracle", [False, True])
def test_drafter_trees_match_plain_greedy(name, oracle):
    """Trees are verified where the window is out of reach (the tree mask does not encode a window); where
    generation can reach it the call drafts chains, with a warning that says why. Lossless either way."""
    target, input_ids, new = context(name)
    drafter = oracle_for(target, input_ids, 4, new) if oracle else make_drafter(target, block_size=4)
    drafter.draft_tree = 8
    if reaches_the_window(target, input_ids.shape[1] + new, 8):
        with pytest.warns(UserWarning, match="a sliding window generation can reach"):
            matches_plain_greedy(target, drafter, input_ids, new)
        assert drafter.last_acceptance.tree_sizes == []
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            matches_plain_greedy(target, drafter, input_ids, new)
        assert max(drafter.last_acceptance.tree_sizes) == 8
    if oracle:
        assert sum(drafter.last_acceptance.acceptance_lengths) + 1 == new
        assert max(drafter.last_acceptance.acceptance_lengths) == min(4, new - 1)


# --- hybrid drafting ---


@pytest.mark.parametrize("name", [SHORT, LONG])
@pytest.mark.parametrize("repeats", [True, False])
@pytest.mark.parametrize("draft_tree", [None, 6])
def test_hybrid_matches_plain_greedy(name, repeats, draft_tree):
    """prompt_lookup_num_tokens=3 beside the block (a fixed block: no cost timing). Within reach of the window
    the branches are verified as one tree; beyond it the round verifies one branch (a chain)."""
    window, _, new = CONTEXTS[name]
    target = make_gemma3(window)
    input_ids = repeating_prompt(0, repeats, length=11)  # 11 tokens: beyond window 8 from the prefill on
    drafter = make_drafter(target, block_size=4)
    drafter.block_size_policy = 4
    drafter.draft_tree = draft_tree
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # trees refused beyond the window (tested above)
        matches_plain_greedy(target, drafter, input_ids, new, prompt_lookup_num_tokens=3)
    stats = drafter.last_acceptance
    assert sum(stats.acceptance_lengths) + (not stats.first_round_in_prefill) == new
    block_nodes = draft_tree or 4
    if reaches_the_window(target, input_ids.shape[1] + new, block_nodes + 3):
        assert max(stats.tree_sizes) <= 4  # one branch: the block's chain (4 nodes) or the n-gram chain (1 + 3)
    elif repeats:
        assert max(stats.tree_sizes) > block_nodes  # the n-gram branch grafted onto the block: one tree
    if repeats:
        assert sum(stats.ngram_tokens) > 0  # the n-gram branch was accepted


def test_hybrid_oracle_drafter_beyond_the_window():
    target = make_gemma3(BEYOND)
    input_ids = repeating_prompt(3, True, length=11)
    drafter = oracle_for(target, input_ids, 4, 30)
    drafter.block_size_policy = 4
    matches_plain_greedy(target, drafter, input_ids, 30, prompt_lookup_num_tokens=3)
    stats = drafter.last_acceptance
    rounds = stats.acceptance_lengths[1:] if stats.first_round_in_prefill else stats.acceptance_lengths
    assert all(length >= 4 for length in rounds[:-1])


@pytest.mark.parametrize("setting", ["chain-adaptive", "hybrid-default", "tree-auto"])
def test_measured_cost_model_on_a_sliding_window_target(setting, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path))  # no cached cost model: it is measured
    target = make_gemma3(BEYOND)
    drafter = make_drafter(target, block_size=4)
    extra = {}
    if setting == "chain-adaptive":
        drafter.block_size_policy = "adaptive"
    elif setting == "hybrid-default":
        extra = {"prompt_lookup_num_tokens": 3}
    else:
        drafter.draft_tree = "auto"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        matches_plain_greedy(target, drafter, repeating_prompt(1, True, length=11), 12, **extra)


# --- batches ---


def test_batched_within_the_window_matches_plain_batched_greedy():
    """A left-padded batch of 3 whose generation cannot reach the window (64 > 2 max_length + block)."""
    target = make_gemma3(WITHIN)
    drafter = make_drafter(target, block_size=4)
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        input_ids, attention_mask = random_batch(generator, 3, shortest=2, longest=8)
        eos = eos_mid_way(target, input_ids, attention_mask, 12, generator)
        kwargs = dict(attention_mask=attention_mask, do_sample=False, pad_token_id=PAD, max_new_tokens=12)
        for stop in (None, eos):
            expected = target.generate(input_ids, eos_token_id=stop, **kwargs)
            actual = target.generate(input_ids, eos_token_id=stop, assistant_model=drafter, **kwargs)
            assert torch.equal(actual, expected)


@pytest.mark.parametrize("name", ["generation-beyond-window", "prompt-beyond-window", "within-small-window"])
def test_batched_with_a_reachable_window_is_refused_naming_the_window(name):
    """Rows of a batch leave holes where their drafts were rejected, and a window counts slots: a batch whose
    generation can reach the window is refused before anything runs (plain batched decoding still serves it)."""
    window, length, new = CONTEXTS[name]
    target = make_gemma3(window)
    input_ids, attention_mask = random_batch(torch.Generator().manual_seed(1), 3, shortest=2, longest=length)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=new, pad_token_id=PAD, **GREEDY)
    with pytest.raises(
        ValueError, match=rf"Batched DFlash does not support a target sliding window \({window} tokens\)"
    ):
        target.generate(input_ids, assistant_model=make_drafter(target, block_size=4), **kwargs)
    assert target.generate(input_ids, **kwargs).shape == (3, input_ids.shape[1] + new)


# --- compiled verification (static cache) ---


def cpu_compile_config() -> CompileConfig:
    config = CompileConfig(dynamic=False)
    config._compile_all_devices = True  # transformers compiles the decoding step on accelerators only otherwise
    return config


@pytest.mark.slow
def test_compiled_verification_within_the_window_matches_plain_greedy():
    """A static cache no longer than the window (its sliding layers roll back: they never evict), verification
    compiled at one width; partly-right drafts so rounds accept, reject and get padded. One compile (~1 min)."""
    target = make_gemma3(32)
    input_ids = prompt(0, length=5)
    drafter = noisy_oracle(target, input_ids, 4, 8, noise=0.3, seed=2)  # rounds of 2, 2, 3 tokens
    widths = []
    get_compiled_call = target.get_compiled_call

    def spying(config):
        compiled = get_compiled_call(config)
        return lambda **inputs: widths.append(inputs["input_ids"].shape[1]) or compiled(**inputs)

    target.get_compiled_call = spying
    compiled = dict(cache_implementation="static", compile_config=cpu_compile_config(), max_cache_len=5 + 8 + 4)
    matches_plain_greedy(target, drafter, input_ids, 8, **compiled)
    assert widths and set(widths) == {4}  # the rounds after the prefill ran compiled, at one shape
    assert any(1 < length < 4 for length in drafter.last_acceptance.acceptance_lengths)  # partial blocks


@pytest.mark.parametrize("compile_config", [False, True])
def test_a_static_cache_longer_than_the_window_is_refused_naming_its_sliding_layers(compile_config):
    """Transformers' StaticSlidingWindowLayer longer than its window overwrites evicted keys in place and cannot
    crop back (`is_croppable` False): refused before any forward or compile, with the fix."""
    target = make_gemma3(BEYOND)
    extra = {"compile_config": cpu_compile_config()} if compile_config else {}
    with pytest.raises(ValueError, match="StaticSlidingWindowLayer layers cannot be rolled back"):
        target.generate(
            prompt(0, length=5), max_new_tokens=30, assistant_model=make_drafter(target, block_size=4),
            cache_implementation="static", **GREEDY, **extra,
        )  # fmt: skip
    assert not hasattr(target, "_compiled_call")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["plain-compiled", "plain-packed-compiled"])
def test_compiled_plain_decoding_past_the_window_compiles_nothing_after_its_warm_up(method):
    """The bench's compiled plain rows on a target whose generation runs past its window: after the warm-up call
    (4 tokens, as the bench's), 20 tokens past the window compile no graph and equal eager greedy (fp32).
    Transformers 5.25's StaticSlidingWindowLayer keeps its length in a Python int that dynamo guards on, so with
    it every step recompiled until dynamo's limit. One compile (~1 min)."""
    target, input_ids = make_gemma3(BEYOND), prompt(0, length=5)
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    generate_with(method, target, None, inputs, dict(max_new_tokens=4, **GREEDY))
    timed = generate_with(method, target, None, inputs, dict(max_new_tokens=20, **GREEDY))
    assert timed.compiles == 0
    assert torch.equal(timed.sequences, plain_greedy(target, input_ids, max_new_tokens=20, eos_token_id=None))


def test_compiled_plain_caches_hold_no_python_length_while_our_loop_keeps_windows_it_cannot_prove_unreached():
    """`compiled_generate_kwargs`: plain decoding (Transformers masks each sliding layer by the config's window)
    gets full static layers; our loop gets them only where its window covers every slot (nothing is evicted,
    the same attention), else Transformers' sliding layers, which it refuses beyond the window."""
    target = make_gemma3(WITHIN)
    kinds = {
        (slots, plain): {
            type(layer) for layer in compiled_generate_kwargs(target, slots, plain=plain)[cache_keyword(target)].layers
        }
        for slots in (WITHIN, 4 * WITHIN)
        for plain in (False, True)
    }
    assert kinds[(WITHIN, False)] == kinds[(WITHIN, True)] == kinds[(4 * WITHIN, True)] == {StaticLayer}
    assert kinds[(4 * WITHIN, False)] == {StaticLayer, StaticSlidingWindowLayer}


# --- sampling ---


@torch.no_grad()
def check_sampled_second_token(target, drafter, prefix: torch.LongTensor, draws: int, label: str) -> None:
    """tests.helpers.generation.check_sampled_second_token with a prefix of our choice (one beyond the window)."""
    warpers = dict(temperature=0.8, top_k=40, top_p=0.95)
    p_second = second_token_marginal(target, prefix, **warpers)  # plain forwards: the window applied by the mask
    torch.manual_seed(0)
    counts = torch.zeros_like(p_second)
    rounds = []
    for _ in range(draws):
        out = target.generate(
            prefix, do_sample=True, max_new_tokens=3, assistant_model=drafter, eos_token_id=None, **warpers
        )
        counts[out[0, prefix.shape[1] + 1]] += 1
        rounds += drafter.last_acceptance.acceptance_lengths
    assert chi_square_against(counts, p_second, label).pvalue > ALPHA
    assert max(rounds) >= 2  # drafts were accepted, not only rejected


@pytest.mark.parametrize("name", [SHORT, "prompt-beyond-window"])
def test_sampling_keeps_the_target_distribution(name):
    """Chi-square of the 2nd new token (drafted, then verified by rejection sampling), the prefix within the
    window or beyond it (12 tokens, window 8: rejected drafts roll back past evicted keys)."""
    target, prefix, _ = context(name, seed=3)
    drafter = make_drafter(target, block_size=4, seed=4)
    check_sampled_second_token(target, drafter, prefix, draws=500, label=f"gemma3 {name}")


# --- the real Gemma 3 270M ---

GEMMA = "gemma3-270m"
GEMMA_SPEC = KNOWN_TARGETS[GEMMA]
GEMMA_INSTALLED = all(importlib.util.find_spec(part.package) is not None for part in GEMMA_SPEC.parts)
real_gemma = [
    pytest.mark.real_model,
    pytest.mark.skipif(not GEMMA_INSTALLED, reason=f"Gemma 3 270M packages missing: {GEMMA_SPEC.install_hint}"),
]
SENTENCE = " The quick brown fox jumps over the lazy dog near the river bank."


class PositionOracle(DFlashDraftModel):
    """An always-right drafter for a large vocabulary (the conftest oracle inverts a 128-row LM head): its outputs
    carry each slot's position, and its draft logits put all the weight on the known greedy token there."""

    def __init__(self, config, greedy_sequence: torch.LongTensor):
        super().__init__(config)
        self.greedy_sequence = greedy_sequence[0]

    def forward(self, noise_embeds, context_hidden_states, position_ids=None, attention_mask=None, cache=None, **kw):
        output = super().forward(noise_embeds, context_hidden_states, position_ids, attention_mask, cache, **kw)
        hidden = torch.zeros_like(output.last_hidden_state)
        hidden[..., 0] = position_ids[:, -noise_embeds.shape[1] :].to(hidden.dtype)
        return BaseModelOutputWithPast(last_hidden_state=hidden)

    def draft_logits(self, hidden_states, lm_head, full_vocab: bool = True):
        positions = hidden_states[..., 0].round().long().clamp(max=len(self.greedy_sequence) - 1)
        logits = hidden_states.new_zeros(*hidden_states.shape[:-1], self.config.vocab_size)
        return logits.scatter_(-1, self.greedy_sequence[positions][..., None], 100.0)


@pytest.fixture(scope="module")
def gemma3(real_cache_dir):
    """(Gemma 3 270M in fp32, tokenizer, {context name: (prompt, new tokens, plain greedy output)})."""
    target, tokenizer = load_target(GEMMA, dtype="float32", cache_dir=real_cache_dir)
    window = target.config.sliding_window
    short = tokenizer("The capital of France is", return_tensors="pt").input_ids
    sentence = tokenizer(SENTENCE, add_special_tokens=False).input_ids
    repeated = (sentence * (window // len(sentence) + 2))[: window + 7]
    long = torch.tensor([[tokenizer.bos_token_id, *repeated]])  # window + 8 tokens: the prefill evicts
    cases = {}
    for name, input_ids, new in (("short", short, 12), ("beyond-window", long, 8)):
        cases[name] = (input_ids, new, plain_greedy(target, input_ids, max_new_tokens=new, eos_token_id=None))
    return target, tokenizer, cases


def real_drafter(target, oracle_for_sequence=None) -> DFlashDraftModel:
    torch.manual_seed(0)
    config = DFlashConfig.from_target_config(target.config, num_hidden_layers=1, block_size=8, num_target_features=2)
    if oracle_for_sequence is None:
        return DFlashDraftModel(config).eval()
    return PositionOracle(config, oracle_for_sequence).eval()


@pytest.mark.parametrize("case", [pytest.param(name, marks=real_gemma) for name in ("short", "beyond-window")])
@pytest.mark.parametrize("oracle", [False, True])
def test_real_gemma3_chain_tree_hybrid_match_plain_greedy(gemma3, case, oracle):
    target, _, cases = gemma3
    config = target.config
    assert "sliding_attention" in config.layer_types and "full_attention" in config.layer_types
    window = config.sliding_window
    input_ids, new, expected = cases[case]
    assert (input_ids.shape[1] + new > window) == (case == "beyond-window")
    if oracle:
        greedy = plain_greedy(target, input_ids, max_new_tokens=new + 8, eos_token_id=None)
        drafter = real_drafter(target, greedy)
    else:
        drafter = real_drafter(target)
    seconds = {}
    for mode in ("chain", "tree", "hybrid"):
        drafter.draft_tree = 8 if mode == "tree" else None
        drafter.block_size_policy = 8 if mode == "hybrid" else None  # hybrid: a fixed block (no cost timing)
        extra = {"prompt_lookup_num_tokens": 3} if mode == "hybrid" else {}
        start = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UserWarning)
            actual = target.generate(input_ids, max_new_tokens=new, assistant_model=drafter, **GREEDY, **extra)
        seconds[mode] = round(time.perf_counter() - start, 1)
        assert torch.equal(actual, expected), mode
        stats = drafter.last_acceptance
        refused = any("sliding window generation can reach" in str(w.message) for w in caught)
        if mode == "tree":
            assert refused == (case == "beyond-window")  # the tree mask does not encode a window
            assert bool(stats.tree_sizes) == (case == "short")
        if oracle and mode != "hybrid":
            assert max(stats.acceptance_lengths) == min(8, new - 1)
    print(f"gemma3-270m {case} ({input_ids.shape[1]} + {new} tokens, window {window}), oracle={oracle}: {seconds}")
