"""Static cache + compiled verification: the loop compiles the target's verification forward exactly where
Transformers' own decoding compiles its step, with one input shape per block length, and stays lossless
(SPEC §5 oracle 2, fp32 greedy)."""

import pytest
import torch
from transformers import CompileConfig

from hf_dflash.generation import decoding
from tests.conftest import make_drafter, make_target
from tests.test_generation_greedy import plain_greedy, prompt


def cpu_compile_config() -> CompileConfig:
    config = CompileConfig(dynamic=False)
    config._compile_all_devices = True  # transformers compiles the decoding step on accelerators only otherwise
    return config


class WidthSpy:
    """Wraps `target.get_compiled_call` so the test sees the width of every compiled round."""

    def __init__(self, target):
        self.widths: list[int] = []
        original = target.get_compiled_call

        def get_compiled_call(config):
            compiled = original(config)

            def call(**inputs):
                self.widths.append(inputs["input_ids"].shape[1])
                return compiled(**inputs)

            return call

        target.get_compiled_call = get_compiled_call


def compiled_dflash(target, drafter, input_ids, max_new_tokens: int, **kwargs) -> torch.LongTensor:
    return target.generate(
        input_ids,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        assistant_model=drafter,
        cache_implementation="static",
        compile_config=cpu_compile_config(),
        **kwargs,
    )


@pytest.mark.slow
@pytest.mark.parametrize("headroom", [4, 0])
def test_compiled_rounds_have_one_shape_and_match_plain_greedy(monkeypatch, headroom):
    """With `block_size` free slots beyond max_length (`max_cache_len`), the last rounds are padded to the
    block; without them, the rounds whose padded block would not fit run eager (no index error, no new
    shape): one compiled shape either way."""
    target = make_target("llama")
    input_ids = prompt(0, length=9)
    max_new_tokens = 23  # not a multiple of what rounds commit: the last rounds fit fewer drafts
    expected = plain_greedy(target, input_ids, max_new_tokens=max_new_tokens, eos_token_id=None)
    drafter = make_drafter(target, block_size=4)  # random: rejections roll the static cache back
    paddings = []
    pad_round = decoding.pad_round
    monkeypatch.setattr(decoding, "pad_round", lambda tokens, n: paddings.append(n) or pad_round(tokens, n))
    spy = WidthSpy(target)
    max_length = input_ids.shape[1] + max_new_tokens
    room = {"max_cache_len": max_length + headroom} if headroom else {}  # default: max_length - 1 slots
    actual = compiled_dflash(target, drafter, input_ids, max_new_tokens, **room)
    assert torch.equal(actual, expected)
    assert spy.widths and set(spy.widths) == {4}  # every compiled round: one graph
    rounds_after_prefill = len(drafter.last_acceptance.acceptance_lengths)
    if headroom:
        assert paddings and len(spy.widths) == rounds_after_prefill  # the short last rounds were padded
    assert 1 in drafter.last_acceptance.acceptance_lengths  # some round rejected drafts


def test_static_cache_without_compile_stays_eager_and_unpadded(monkeypatch):
    target = make_target("llama")
    input_ids = prompt(2, length=9)
    drafter = make_drafter(target, block_size=4)
    monkeypatch.setattr(decoding, "pad_round", lambda *args: pytest.fail("an eager round was padded"))
    actual = target.generate(
        input_ids, do_sample=False, max_new_tokens=21, eos_token_id=None, assistant_model=drafter,
        cache_implementation="static",
    )  # fmt: skip
    assert torch.equal(actual, plain_greedy(target, input_ids, max_new_tokens=21, eos_token_id=None))
    assert not hasattr(target, "_compiled_call")  # no compile on CPU unless compile_config asks for it


def test_dynamic_cache_stays_eager():
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    input_ids = prompt(1)
    actual = target.generate(
        input_ids, do_sample=False, max_new_tokens=12, assistant_model=drafter, compile_config=cpu_compile_config()
    )
    assert torch.equal(actual, plain_greedy(target, input_ids, max_new_tokens=12))
    assert not hasattr(target, "_compiled_call")


def test_inductor_freezing_is_refused_before_anything_compiles():
    """Freezing folds the static cache into the graph: a second call would verify against the first call's
    cache (measured on SmolLM2: τ 2.00 -> 1.29). Refused with the fix, before any compile."""
    import torch._inductor.config as inductor_config

    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    with inductor_config.patch(freezing=True), pytest.raises(ValueError, match="freezing = False"):
        compiled_dflash(target, drafter, prompt(3), 8)
    assert not hasattr(target, "_compiled_call")


def test_a_cache_that_cannot_roll_back_is_refused_with_the_fix(monkeypatch):
    """Transformers 5.23's static layers have no `crop`: rejected drafts could not be rolled back."""
    from transformers.cache_utils import StaticLayer

    monkeypatch.setattr(StaticLayer, "is_croppable", False)
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    with pytest.raises(ValueError, match="StaticLayer layers cannot be rolled back .* from 5.24 on"):
        target.generate(prompt(4), max_new_tokens=4, assistant_model=drafter, cache_implementation="static")


@pytest.mark.slow
def test_compiled_sampling_preserves_target_distribution():
    """SPEC §5 oracle 3 through the compiled, padded rounds (3 new tokens after a 4-token block: the round
    after the prefill fits one draft and is padded)."""
    from tests.test_generation_sampling import check_sampled_second_token

    target = make_target("qwen3", seed=3)
    drafter = make_drafter(target, block_size=4, seed=4)
    spy = WidthSpy(target)
    compiled = dict(cache_implementation="static", compile_config=cpu_compile_config(), max_cache_len=5 + 3 + 4)
    check_sampled_second_token(target, drafter, "compiled generate(do_sample)", draws=600, **compiled)
    assert spy.widths and set(spy.widths) == {4}
