"""The generate hook is narrow; pairing errors are clear; Transformers' built-in DFlash path works."""

import pytest
import torch
from transformers import AutoModel, Qwen3Config
from transformers.cache_utils import DFlashCache
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3PreTrainedModel, Qwen3RMSNorm

import hf_dflash
import hf_dflash.generation.hook as hook
from hf_dflash import DFlashDraftModel
from hf_dflash.checkpoints import drafter_from_model, official_config_dict, save_official
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
    assert torch.equal(
        target.generate(PROMPT, do_sample=False, max_new_tokens=20, prompt_lookup_num_tokens=3), expected
    )


def test_builtin_transformers_dflash_path_accepts_our_drafter(forbid_dflash_loop):
    """A Hub user without our package calls `speculation_type="dflash"`: same weights, plain-greedy output."""
    target = make_target("qwen3")
    for block_size in (2, 4, 16):
        drafter = make_drafter(target, block_size=block_size)
        expected = target.generate(PROMPT, do_sample=False, max_new_tokens=23, eos_token_id=None)
        actual = target.generate(
            PROMPT,
            do_sample=False,
            max_new_tokens=23,
            eos_token_id=None,
            assistant_model=drafter,
            speculation_type="dflash",
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


def test_the_hook_is_version_checked():
    """Wrapped only on a tested release whose methods take the expected parameters (the installed one is)."""
    import transformers

    assert hook.unsupported_reason(transformers.__version__) is None
    assert "Transformers 5.99.0 is not a release it was tested on (5.23" in hook.unsupported_reason("5.99.0")
    assert "5.26.0.dev0" in hook.unsupported_reason("5.26.0.dev0")
    renamed = {**hook.WRAPPED_PARAMETERS, "_assisted_decoding": ["self", "input_ids", "candidate_generator"]}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hook, "WRAPPED_PARAMETERS", renamed)
        assert "GenerationMixin._assisted_decoding of Transformers" in hook.unsupported_reason(transformers.__version__)


def test_an_unknown_transformers_release_refuses_dflash_assistants_clearly(monkeypatch):
    """On an untested release nothing internal is wrapped; a DFlash assistant is refused with the way out, and
    every other call (plain decoding, other assistants, Transformers' own DFlash loop) runs unchanged."""
    mixin = hook.GenerationMixin
    for name in ("_validate_generation_mode", "_assisted_decoding"):
        monkeypatch.setattr(mixin, name, getattr(mixin, name)._hf_dflash_original)
    monkeypatch.setattr(mixin, "generate", mixin.generate)  # restored after the test
    hook.install_generate_hook(version="5.99.0")
    hook.install_generate_hook(version="5.99.0")  # idempotent
    assert not hasattr(mixin._assisted_decoding, "_hf_dflash_original")
    assert mixin.generate._hf_dflash_refusal and not hasattr(mixin.generate.__wrapped__, "_hf_dflash_refusal")
    target = make_target("qwen3")
    drafter = make_drafter(target)
    with pytest.raises(ValueError, match=r"Transformers 5\.99\.0 is not a release.*custom_generate=.*<5\.26"):
        target.generate(PROMPT, max_new_tokens=5, assistant_model=drafter)
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=12, eos_token_id=None)
    builtin = target.generate(
        PROMPT,
        do_sample=False,
        max_new_tokens=12,
        eos_token_id=None,
        assistant_model=drafter,
        speculation_type="dflash",
    )
    assert torch.equal(builtin, expected)
    other = target.generate(PROMPT, do_sample=False, max_new_tokens=12, eos_token_id=None, assistant_model=target)
    assert torch.equal(other, expected)


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
            PROMPT,
            max_new_tokens=5,
            assistant_model=make_drafter(target),
            return_dict_in_generate=True,
            output_attentions=True,
        )


# ---------------------------------------------------------------- options DFlash cannot serve (issue #13 B7)


def test_prompt_lookup_with_the_builtin_dflash_loop_is_refused_not_dropped():
    """With speculation_type="dflash" Transformers would run prompt lookup alone and never call the drafter;
    without it our loop uses both (hybrid drafting, tests/test_generation_hybrid.py)."""
    target = make_target("llama")
    with pytest.raises(ValueError, match=r"prompt_lookup_num_tokens=3 with speculation_type='dflash'"):
        target.generate(
            PROMPT,
            max_new_tokens=5,
            assistant_model=make_drafter(target),
            prompt_lookup_num_tokens=3,
            speculation_type="dflash",
        )
    plain = target.generate(PROMPT, max_new_tokens=5, do_sample=False)
    hybrid = target.generate(
        PROMPT, max_new_tokens=5, do_sample=False, assistant_model=make_drafter(target), prompt_lookup_num_tokens=3
    )
    assert torch.equal(plain, hybrid)


@pytest.mark.parametrize(
    "options, match",
    [(dict(num_beams=2), r"num_beams=2 \(beam search\)"), (dict(num_beams=3, do_sample=True), r"num_beams=3")],
    ids=["beam_search", "beam_sample"],
)
def test_beam_search_with_a_dflash_drafter_is_refused_and_clears_old_stats(options, match):
    """Transformers only warns and runs beam search without the drafter."""
    target = make_target("llama")
    drafter = make_drafter(target)
    target.generate(PROMPT, do_sample=False, max_new_tokens=6, assistant_model=drafter)
    assert drafter.last_acceptance is not None
    with pytest.raises(ValueError, match=match):
        target.generate(PROMPT, max_new_tokens=5, assistant_model=drafter, **options)
    assert drafter.last_acceptance is None  # no statistics of an earlier call pass for this one


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
def test_guidance_scale_with_a_dflash_drafter_is_refused_by_name(do_sample):
    """Issue 25 B5: Transformers died inside its guidance processor (Sizes of tensors must match); a named
    refusal up front instead. guidance_scale=1 is no guidance and runs."""
    target = make_target("llama")
    drafter = make_drafter(target)
    with pytest.raises(ValueError, match=r"guidance_scale=1.5 \(classifier-free guidance\) cannot use a DFlash"):
        target.generate(PROMPT, max_new_tokens=5, do_sample=do_sample, assistant_model=drafter, guidance_scale=1.5)
    plain = target.generate(PROMPT, max_new_tokens=5, do_sample=False)
    assert torch.equal(
        target.generate(PROMPT, max_new_tokens=5, do_sample=False, assistant_model=drafter, guidance_scale=1), plain
    )


# ---------------------------------------------------------------- drafters from other code (issue #13 A2)


class ForeignDFlashDraftModel(Qwen3PreTrainedModel):
    """Stands in for a drafter class loaded through someone else's remote code (z-lab's repos name
    theirs `DFlashDraftModel`): a Qwen3Config with `dflash_config`, the SPEC weight names, and a forward
    Transformers' plain assisted decoding would misuse."""

    def __init__(self, config):
        super().__init__(config)
        self.layers = torch.nn.ModuleList([Qwen3DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.fc = torch.nn.Linear(
            len(config.dflash_config["target_layer_ids"]) * config.hidden_size, config.hidden_size, bias=False
        )
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()


def foreign_copy(drafter) -> ForeignDFlashDraftModel:
    official = official_config_dict(drafter.config, torch.float32)
    config = Qwen3Config(**{k: v for k, v in official.items() if k not in ("auto_map", "architectures")})
    foreign = ForeignDFlashDraftModel(config).eval()
    foreign.load_state_dict(drafter.state_dict(), strict=True)
    return foreign


def test_a_foreign_dflash_drafter_is_refused_with_the_way_to_load_it():
    target = make_target("qwen3")
    foreign = foreign_copy(make_drafter(target))
    with pytest.raises(
        ValueError, match=r"ForeignDFlashDraftModel.*hf_dflash\.load_drafter.*hf_dflash\.drafter_from_model"
    ):
        target.generate(PROMPT, do_sample=False, max_new_tokens=8, assistant_model=foreign)
    assert hf_dflash.load_drafter and hf_dflash.drafter_from_model is drafter_from_model  # the names it gives exist


def test_a_foreign_dflash_drafter_converts_and_runs_dflash():
    target = make_target("qwen3")
    drafter = make_drafter(target)
    converted = drafter_from_model(foreign_copy(drafter))
    assert isinstance(converted, DFlashDraftModel) and converted.config.target_layer_ids == [1, 3]
    noise, context = torch.randn(1, 4, 32), torch.randn(1, 6, 64)
    with torch.no_grad():
        assert torch.equal(
            converted(noise_embeds=noise, context_hidden_states=context).last_hidden_state,
            drafter(noise_embeds=noise, context_hidden_states=context).last_hidden_state,
        )
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=12, eos_token_id=None)
    actual = target.generate(PROMPT, do_sample=False, max_new_tokens=12, eos_token_id=None, assistant_model=converted)
    assert torch.equal(actual, expected) and converted.last_acceptance is not None


def test_an_official_folder_loaded_without_remote_code_is_refused(tmp_path):
    """`AutoModel.from_pretrained(official_folder)` alone is a plain Qwen3Model (fc/hidden_norm dropped):
    as an assistant it must not fall into plain assisted decoding."""
    target = make_target("qwen3")
    folder = save_official(make_drafter(target), tmp_path / "official")
    plain = AutoModel.from_pretrained(folder)
    assert type(plain).__name__ == "Qwen3Model"
    with pytest.raises(ValueError, match=r"hf_dflash\.load_drafter"):
        target.generate(PROMPT, do_sample=False, max_new_tokens=8, assistant_model=plain)
    with pytest.raises(ValueError, match=r"fc\.weight"):
        drafter_from_model(plain)


def test_a_dflash2_model_is_named():
    target = make_target("qwen3")
    foreign = foreign_copy(make_drafter(target))
    foreign.config.dflash_config = {**foreign.config.dflash_config, "conv_kernel_size": 2, "selector_rank": 8}
    with pytest.raises(ValueError, match="DFlash2"):
        drafter_from_model(foreign)
