"""Static cache + compiled verification: the loop compiles the target's verification forward exactly where
Transformers' own decoding compiles its step, and stays lossless (SPEC §5 oracle 2, fp32 greedy)."""

import torch
from transformers import CompileConfig

from tests.conftest import make_drafter, make_target
from tests.test_generation_greedy import plain_greedy, prompt


def cpu_compile_config() -> CompileConfig:
    config = CompileConfig(dynamic=False)
    config._compile_all_devices = True  # transformers compiles the decoding step on accelerators only otherwise
    return config


def test_static_cache_with_compile_config_compiles_verification_and_matches_plain_greedy():
    target = make_target("llama")
    input_ids = prompt(0, length=9)
    expected = plain_greedy(target, input_ids, max_new_tokens=24, eos_token_id=None)
    drafter = make_drafter(target, block_size=4)  # random: rejections roll the static cache back
    drafter.block_size_policy = 4  # one verification length (and the shorter ones of the last rounds)
    actual = target.generate(
        input_ids,
        do_sample=False,
        max_new_tokens=24,
        eos_token_id=None,
        assistant_model=drafter,
        cache_implementation="static",
        compile_config=cpu_compile_config(),
    )
    assert torch.equal(actual, expected)
    assert hasattr(target, "_compiled_call")  # the verification rounds ran the compiled forward
    assert 1 in drafter.last_acceptance.acceptance_lengths  # some round rejected drafts


def test_dynamic_cache_stays_eager():
    target = make_target("llama")
    drafter = make_drafter(target, block_size=4)
    input_ids = prompt(1)
    actual = target.generate(
        input_ids, do_sample=False, max_new_tokens=12, assistant_model=drafter, compile_config=cpu_compile_config()
    )
    assert torch.equal(actual, plain_greedy(target, input_ids, max_new_tokens=12))
    assert not hasattr(target, "_compiled_call")
