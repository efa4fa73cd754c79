"""The generate hook is narrow; pairing errors are clear; Transformers' built-in DFlash path works."""

import pytest
import torch
from transformers.cache_utils import DFlashCache

import hf_dflash.generation.hook as hook
from tests.conftest import make_drafter, make_target

PROMPT = torch.tensor([[5, 17, 33, 9, 71, 4]])


@pytest.fixture
def forbid_dflash_loop(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the DFlash loop must not run for this call")

    monkeypatch.setattr(hook, "dflash_decoding", fail)


def test_normal_assistant_model_is_untouched(forbid_dflash_loop):
    target, assistant = make_target("llama"), make_target("llama", seed=7)
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=20)
    actual = target.generate(PROMPT, do_sample=False, max_new_tokens=20, assistant_model=assistant)
    assert torch.equal(actual, expected)


def test_prompt_lookup_is_untouched(forbid_dflash_loop):
    target = make_target("llama")
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=20)
    assert torch.equal(target.generate(PROMPT, do_sample=False, max_new_tokens=20, prompt_lookup_num_tokens=3), expected)


def test_builtin_transformers_dflash_path_accepts_our_drafter(forbid_dflash_loop):
    """A Hub user without our package calls `speculation_type="dflash"`: same weights, plain-greedy output."""
    target = make_target("qwen3")
    for block_size in (2, 4, 16):
        drafter = make_drafter(target, block_size=block_size)
        expected = target.generate(PROMPT, do_sample=False, max_new_tokens=23, eos_token_id=None)
        actual = target.generate(
            PROMPT, do_sample=False, max_new_tokens=23, eos_token_id=None,
            assistant_model=drafter, speculation_type="dflash",
        )
        assert torch.equal(actual, expected)


@pytest.mark.parametrize("cache_keyword", ["cache", "past_key_values"])
def test_drafter_accepts_both_cache_keywords(cache_keyword):
    """Transformers 5.23 passes `past_key_values=`, 5.24 passes `cache=`."""
    drafter = make_drafter(make_target("llama"))
    cache = DFlashCache(config=drafter.config)
    noise, context = torch.randn(1, 4, 32), torch.randn(1, 6, 64)
    drafter(noise_embeds=noise, context_hidden_states=context, **{cache_keyword: cache})
    assert cache.get_seq_length() == 6 + 4


def test_hook_is_installed_once():
    import importlib

    import hf_dflash

    original = hook.GenerationMixin._assisted_decoding
    importlib.reload(hf_dflash)
    hook.install_generate_hook()
    assert hook.GenerationMixin._assisted_decoding is original


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(hidden_size=48), "differs from the target embedding width 32"),
        (dict(target_hidden_size=48), "target hidden size 48"),
        (dict(vocab_size=64, mask_token_id=5), "vocab_size 64 differs from the target's embedding rows 128"),
        (dict(num_target_layers=12, target_layer_ids=[1, 9]), r"\[1, 9\].*6 decoder layers"),
    ],
)
def test_mismatched_drafter_is_refused(change, message):
    target = make_target("llama")
    drafter = make_drafter(target, **change)
    with pytest.raises(ValueError, match=message):
        target.generate(PROMPT, max_new_tokens=5, assistant_model=drafter)


def test_dtype_mismatch_is_refused():
    target = make_target("llama")
    drafter = make_drafter(target).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"call drafter.to\(torch.float32\)"):
        target.generate(PROMPT, max_new_tokens=5, assistant_model=drafter)


def test_output_attentions_is_refused_clearly():
    target = make_target("llama")
    with pytest.raises(ValueError, match="output_attentions"):
        target.generate(
            PROMPT, max_new_tokens=5, assistant_model=make_drafter(target),
            return_dict_in_generate=True, output_attentions=True,
        )
