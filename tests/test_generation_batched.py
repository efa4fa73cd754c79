"""Batched DFlash (batch size > 1, left-padded prompts): each row == plain `generate` of the same batch.

The primary oracle is plain greedy `generate` of the same left-padded batch (fp32): padding can change
float rounding, so single-row generation is compared only where plain batched agrees with it.
"""

import pytest
import torch
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList

from hf_dflash import DFlashGenerateOutput
from hf_dflash.caches import MAX_WASTE_FRACTION, cache_waste, compact_cache
from tests.conftest import ARCHITECTURES, COMMON, VOCAB, OracleDrafter, make_drafter, make_target
from tests.helpers.generation import PAD, eos_mid_way, random_batch, unpadded


def plain_and_dflash(target, drafter, input_ids, attention_mask, **kwargs):
    kwargs = dict(attention_mask=attention_mask, do_sample=False, pad_token_id=PAD, **kwargs)
    return target.generate(input_ids, **kwargs), target.generate(input_ids, assistant_model=drafter, **kwargs)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("block_size", [2, 5, 16])
def test_random_drafter_matches_plain_batched_greedy(arch, block_size):
    target = make_target(arch)
    drafter = make_drafter(target, block_size=block_size)
    generator = torch.Generator().manual_seed(block_size)
    for _ in range(3):
        batch_size = int(torch.randint(2, 9, (1,), generator=generator))
        max_new_tokens = int(torch.randint(6, 30, (1,), generator=generator))
        input_ids, attention_mask = random_batch(generator, batch_size)
        eos = eos_mid_way(target, input_ids, attention_mask, max_new_tokens, generator)
        expected, actual = plain_and_dflash(
            target, drafter, input_ids, attention_mask, max_new_tokens=max_new_tokens, eos_token_id=eos
        )
        assert torch.equal(actual, expected)


def oracle_for_batch(
    target, input_ids, attention_mask, block_size, max_new_tokens, rows=None, noise=0.0, seed=0
) -> OracleDrafter:
    """Knows each row's single-row greedy continuation, indexed by true position (a batch-aware
    oracle); with `rows`, only those rows' (the others get wrong drafts); with `noise`, that fraction
    of the tokens it knows is replaced by random ones (rows then accept different partial blocks)."""
    rows = [
        target.generate(
            unpadded(input_ids, attention_mask, b),
            do_sample=False,
            eos_token_id=None,
            max_new_tokens=max_new_tokens + block_size,
        )[0]
        for b in (range(len(input_ids)) if rows is None else rows)
    ]
    greedy = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=PAD)
    generator = torch.Generator().manual_seed(seed)
    replace = torch.rand(greedy.shape, generator=generator) < noise
    greedy[replace] = torch.randint(3, VOCAB, (int(replace.sum()),), generator=generator)
    config = make_drafter(target, block_size=block_size).config
    return OracleDrafter(
        config, target.get_output_embeddings().weight, greedy, embedding_weight=target.get_input_embeddings().weight
    ).eval()


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("block_size", [3, 8, 16])
@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_oracle_drafter_matches_plain_batched_greedy(arch, block_size, noise):
    """noise 0: rows accept whole blocks; noise 0.3: every row accepts its own partial blocks, so
    caches collect holes, get compacted and lose finished rows in all combinations."""
    target = make_target(arch)
    generator = torch.Generator().manual_seed(10 + block_size)
    input_ids, attention_mask = random_batch(generator, int(torch.randint(2, 9, (1,), generator=generator)))
    drafter = oracle_for_batch(target, input_ids, attention_mask, block_size, 24, noise=noise, seed=block_size)
    eos = eos_mid_way(target, input_ids, attention_mask, 24, generator)
    expected, actual = plain_and_dflash(target, drafter, input_ids, attention_mask, max_new_tokens=24, eos_token_id=eos)
    assert torch.equal(actual, expected)
    lengths = drafter.last_acceptance.acceptance_lengths
    if noise == 0.0:
        assert max(lengths) == block_size
        assert sum(lengths) / len(lengths) > 1.5  # whole blocks are accepted in one pass, row by row
    else:
        assert len(set(lengths)) > 2  # rows really accept different numbers of drafts


def test_each_row_equals_that_row_generated_alone():
    """Where plain batched greedy agrees with single-row greedy (no rounding flip from padding),
    batched DFlash does too: rows do not leak into each other, holes and compaction included."""
    target = make_target("qwen3")
    drafter = make_drafter(target, block_size=6)
    generator = torch.Generator().manual_seed(3)
    agreeing = 0
    for _ in range(3):
        input_ids, attention_mask = random_batch(generator, 6, shortest=1, longest=14)
        eos = eos_mid_way(target, input_ids, attention_mask, 20, generator)
        expected, actual = plain_and_dflash(
            target, drafter, input_ids, attention_mask, max_new_tokens=20, eos_token_id=eos
        )
        assert torch.equal(actual, expected)
        width = input_ids.shape[1]
        for row in range(len(input_ids)):
            prompt = unpadded(input_ids, attention_mask, row)
            alone = target.generate(prompt, do_sample=False, max_new_tokens=20, eos_token_id=eos)[0, prompt.shape[1] :]
            if torch.equal(expected[row, width : width + len(alone)], alone):
                agreeing += 1
                assert torch.equal(actual[row, width : width + len(alone)], alone)
                assert bool((actual[row, width + len(alone) :] == PAD).all())
    assert agreeing >= 12


def test_cache_waste_stays_bounded():
    """Rows that accept whole blocks next to rows that accept nothing: the others collect ~15 holes a
    round; both caches are compacted before holes exceed the bound."""
    target = make_target("llama")
    generator = torch.Generator().manual_seed(4)
    input_ids, attention_mask = random_batch(generator, 4)
    drafter = oracle_for_batch(target, input_ids, attention_mask, 16, 60, rows=[0, 2])
    kwargs = dict(
        attention_mask=attention_mask, do_sample=False, max_new_tokens=60, eos_token_id=None, pad_token_id=PAD
    )
    expected = target.generate(input_ids, **kwargs)
    target_past, drafter_past = [], []

    def check_waste(pasts):
        def hook(module, args, kwargs):
            cache = kwargs.get("cache", kwargs.get("past_key_values"))  # Transformers 5.23 names it past_key_values
            mask, past = kwargs["attention_mask"], cache.get_seq_length()
            if past:
                pasts.append(past)
                assert cache_waste(mask[:, :past]) <= MAX_WASTE_FRACTION * past

        return hook

    handles = [
        target.register_forward_pre_hook(check_waste(target_past), with_kwargs=True),
        drafter.register_forward_pre_hook(check_waste(drafter_past), with_kwargs=True),
    ]
    try:
        actual = target.generate(input_ids, assistant_model=drafter, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    assert torch.equal(actual, expected)
    assert max(drafter.last_acceptance.acceptance_lengths) == 16
    # compaction really happened: the caches shrank between rounds
    assert any(b < a for a, b in zip(target_past, target_past[1:]))
    assert any(b < a for a, b in zip(drafter_past, drafter_past[1:]))


@pytest.mark.parametrize("arch", ["llama", "mistral_gqa"])  # full-attention and (unreached) sliding-window layers
def test_compact_cache_keeps_each_rows_slots_in_order(arch):
    target = make_target(arch)
    cache = DynamicCache(config=target.config)
    generator = torch.Generator().manual_seed(5)
    mask = (torch.rand(3, 10, generator=generator) > 0.4).long()
    mask[:, -1] = 1
    keys = [torch.randn(3, 2, 10, 4, generator=generator) for _ in cache.layers]
    for layer_idx, layer_keys in enumerate(keys):
        cache.update(layer_keys, -layer_keys, layer_idx)
    new_mask = compact_cache(cache, mask)
    width = int(mask.sum(1).max())
    assert new_mask.shape == (3, width) and cache.get_seq_length() == width
    for row in range(3):
        count = int(mask[row].sum())
        assert new_mask[row].tolist() == [0] * (width - count) + [1] * count  # left-padded
        for layer, layer_keys in zip(cache.layers, keys):
            kept = layer_keys[row][:, mask[row].bool()]
            assert torch.equal(layer.keys[row][:, width - count :], kept)
            assert torch.equal(layer.values[row][:, width - count :], -kept)


class StopAfterToken(StoppingCriteria):
    """Stop a row once it generated `token` after the (padded) prompt."""

    def __init__(self, token: int, prompt_length: int):
        self.token, self.prompt_length = token, prompt_length

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, self.prompt_length :] == self.token).any(-1)


@pytest.mark.parametrize("with_eos", [False, True])
def test_custom_criterion_without_and_with_eos_padding(with_eos):
    """Without an EOS criterion plain `generate` keeps decoding rows that met a criterion until every
    row has stopped; with one it pads them. Both match."""
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    generator = torch.Generator().manual_seed(6)
    input_ids, attention_mask = random_batch(generator, 5)
    stop_token = eos_mid_way(target, input_ids, attention_mask, 25, generator)
    criteria = StoppingCriteriaList([StopAfterToken(stop_token, input_ids.shape[1])])
    eos = eos_mid_way(target, input_ids, attention_mask, 25, generator) if with_eos else None
    expected, actual = plain_and_dflash(
        target, drafter, input_ids, attention_mask, max_new_tokens=25, eos_token_id=eos, stopping_criteria=criteria
    )
    assert torch.equal(actual, expected)


def test_logits_processors_and_return_dict_match_plain():
    target = make_target("mistral_gqa")
    drafter = make_drafter(target, block_size=5)
    generator = torch.Generator().manual_seed(7)
    input_ids, attention_mask = random_batch(generator, 4)
    kwargs = dict(max_new_tokens=20, repetition_penalty=1.5, no_repeat_ngram_size=3, min_new_tokens=8, eos_token_id=5)
    expected, actual = plain_and_dflash(target, drafter, input_ids, attention_mask, **kwargs)
    assert torch.equal(actual, expected)
    output = target.generate(
        input_ids, attention_mask=attention_mask, assistant_model=drafter, return_dict_in_generate=True, **kwargs
    )
    assert isinstance(output, DFlashGenerateOutput) and torch.equal(output.sequences, expected)
    assert output.acceptance_lengths == drafter.last_acceptance.acceptance_lengths


def test_equal_length_prompts_without_attention_mask():
    target = make_target("qwen2")
    drafter = make_drafter(target, block_size=4)
    input_ids = torch.randint(3, VOCAB, (3, 7), generator=torch.Generator().manual_seed(8))
    kwargs = dict(do_sample=False, max_new_tokens=15, eos_token_id=None)
    assert torch.equal(
        target.generate(input_ids, assistant_model=drafter, **kwargs), target.generate(input_ids, **kwargs)
    )


def test_unsupported_batched_options_are_refused_clearly():
    from transformers import MistralConfig, MistralForCausalLM
    from transformers.generation.streamers import BaseStreamer

    target = make_target("llama")
    drafter = make_drafter(target)
    input_ids = torch.randint(3, VOCAB, (2, 5))
    with pytest.raises(ValueError, match="output_scores need batch size 1"):
        target.generate(
            input_ids, max_new_tokens=4, assistant_model=drafter, return_dict_in_generate=True, output_scores=True
        )

    class Ignore(BaseStreamer):
        def put(self, value):
            pass

    with pytest.raises(ValueError, match="Streamers need batch size 1"):
        target.generate(input_ids, max_new_tokens=4, assistant_model=drafter, streamer=Ignore())
    torch.manual_seed(0)
    windowed = MistralForCausalLM(
        MistralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, sliding_window=6)
    )
    with pytest.raises(ValueError, match="sliding window"):
        windowed.generate(input_ids, max_new_tokens=4, assistant_model=make_drafter(windowed))


@torch.no_grad()
def test_batched_sampling_preserves_target_distribution():
    """do_sample with a batch: rejection sampling row by row keeps each row's target distribution.
    Six copies of a prompt next to two shorter (padded) prompts; the 2nd new token of the copies
    follows its exact marginal (chi-square, as in test_generation_sampling)."""
    from tests.helpers.generation import ALPHA, chi_square_against, second_token_marginal

    warpers = dict(temperature=0.8, top_k=40, top_p=0.95)
    target = make_target("qwen3", seed=3)
    drafter = make_drafter(target, block_size=4, seed=4)
    prefix = torch.tensor([[5, 17, 33, 9, 71]])
    p_second = second_token_marginal(target, prefix, **warpers)

    copies = 6
    input_ids = torch.cat([prefix.repeat(copies, 1), torch.tensor([[PAD, PAD, 40, 41, 42], [PAD, 60, 61, 62, 63]])])
    attention_mask = (input_ids != PAD).long()
    torch.manual_seed(0)
    counts = torch.zeros_like(p_second)
    rounds = []
    for _ in range(200):
        out = target.generate(
            input_ids,
            attention_mask=attention_mask,
            do_sample=True,
            max_new_tokens=3,
            assistant_model=drafter,
            eos_token_id=None,
            pad_token_id=PAD,
            **warpers,
        )
        counts += torch.bincount(out[:copies, prefix.shape[1] + 1], minlength=len(counts)).float()
        rounds += drafter.last_acceptance.acceptance_lengths
    assert chi_square_against(counts, p_second, "batched generate(do_sample)").pvalue > ALPHA
    assert max(rounds) >= 2  # drafts really were accepted


def test_one_drafter_pass_and_one_target_pass_per_round_for_the_whole_batch():
    target = make_target("llama")
    generator = torch.Generator().manual_seed(9)
    input_ids, attention_mask = random_batch(generator, 6)
    drafter = oracle_for_batch(target, input_ids, attention_mask, 8, 32)
    calls = {"target": [], "drafter": []}
    handles = [
        target.register_forward_pre_hook(lambda m, a, k: calls["target"].append(len(k["input_ids"])), with_kwargs=True),
        drafter.register_forward_pre_hook(
            lambda m, a, k: calls["drafter"].append(len(k["noise_embeds"])), with_kwargs=True
        ),
    ]
    try:
        target.generate(
            input_ids,
            attention_mask=attention_mask,
            assistant_model=drafter,
            do_sample=False,
            max_new_tokens=32,
            eos_token_id=None,
            pad_token_id=PAD,
        )
    finally:
        for handle in handles:
            handle.remove()
    # prefill, then 4 rounds of <= 8 tokens for all 6 rows at once (the oracle finds a row by its
    # bonus token; where two rows share it, a wrong guess costs that row one more round on its own)
    assert calls["target"][:5] == [6] * 5 and len(calls["target"]) <= 6
    assert calls["drafter"] == calls["target"][1:]  # every round: one drafter pass over the same rows
