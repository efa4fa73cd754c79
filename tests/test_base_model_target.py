"""A base-model target (no chat template): plain-text prompts whose reply is the continuation, and the real
Gemma 3 270M target, whose GGUF is assembled from four part packages (issue 35)."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from hf_dflash import targets
from hf_dflash.data import regenerate
from hf_dflash.data.regenerate import regenerate_responses, render_conversation
from hf_dflash.data.tokenize import tokenize_conversation
from hf_dflash.targets import KNOWN_TARGETS, MARKER_FILE, MissingTargetPackageError, load_target
from tests.conftest import make_target
from tests.helpers.data import assistant, make_char_tokenizer, masked_runs, user

GEMMA = "gemma3-270m"
GEMMA_SPEC = KNOWN_TARGETS[GEMMA]


# --- prompts without a chat template (tiny model, character tokenizer) ---


def test_without_chat_template_the_prompt_is_plain_text_and_the_reply_its_continuation(tmp_path, monkeypatch):
    tokenizer = make_char_tokenizer(chat_template=None)
    assert tokenizer.chat_template is None
    messages = [user("Once upon a time"), assistant(", there was a cat.")]
    assert render_conversation(tokenizer, messages[:1], add_generation_prompt=True) == "<|im_start|>Once upon a time"
    assert render_conversation(tokenizer, messages) == "<|im_start|>Once upon a time, there was a cat."

    seen = []
    real_generate = regenerate.generate_replies

    def recording(model, prompt_ids, **kwargs):
        seen.extend(prompt_ids)
        return real_generate(model, prompt_ids, **kwargs)

    monkeypatch.setattr(regenerate, "generate_replies", recording)
    prompts = [{"id": "p0", "source": "toy", "messages": [user("Once upon a time")]}]
    (path,) = regenerate_responses(
        make_target("llama"), tokenizer, prompts, tmp_path, temperature=1.0, max_new_tokens=6, progress=False
    )
    # BOS, then the text itself: no role header, no generation prompt
    assert seen == [[tokenizer.bos_token_id, *tokenizer("Once upon a time", add_special_tokens=False)["input_ids"]]]
    (row,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert [message["role"] for message in row["messages"]] == ["user", "assistant"]

    input_ids, loss_mask = tokenize_conversation(tokenizer, messages)
    assert input_ids == tokenizer(render_conversation(tokenizer, messages), add_special_tokens=False)["input_ids"]
    assert input_ids[0] == tokenizer.bos_token_id
    assert [tokenizer.decode(run) for run in masked_runs(input_ids, loss_mask)] == [", there was a cat."]


def test_with_a_chat_template_rendering_is_unchanged():
    tokenizer = make_char_tokenizer()
    messages = [user("Hi")]
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert render_conversation(tokenizer, messages, add_generation_prompt=True) == expected


# --- a GGUF in parts (no real package needed) ---


def test_gguf_parts_are_assembled_in_order_and_a_missing_part_names_every_package(tmp_path, monkeypatch):
    files = {}
    for index, part in enumerate(GEMMA_SPEC.parts):
        files[part.package] = tmp_path / f"part{index}"
        files[part.package].write_bytes(bytes([index]) * 3)
    monkeypatch.setattr(targets, "package_file", lambda package, relative, missing, error: files[package])
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    assembled = targets.gguf_source(GEMMA_SPEC, scratch)
    assert assembled == scratch / GEMMA_SPEC.gguf_file
    assert assembled.read_bytes() == b"\x00\x00\x00\x01\x01\x01\x02\x02\x02\x03\x03\x03"

    monkeypatch.undo()
    real_find_spec = importlib.util.find_spec
    absent = GEMMA_SPEC.parts[2].package
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a, **k: None if name == absent else real_find_spec(name, *a, **k)
    )
    with pytest.raises(MissingTargetPackageError) as error:
        load_target(GEMMA, cache_dir=tmp_path / "cache")
    assert GEMMA_SPEC.install_hint in str(error.value)
    assert all(part.requirement in GEMMA_SPEC.install_hint for part in GEMMA_SPEC.parts)
    assert not (tmp_path / "cache").exists()  # the scratch folder is gone, and the cache folder made for it


def test_real_extra_pins_every_target_package():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    extras = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]
    pinned = extras["optional-dependencies"]["real"]
    assert sorted(pinned) == sorted(requirement for spec in KNOWN_TARGETS.values() for requirement in spec.requirements)


# --- the real Gemma 3 270M ---

GEMMA_INSTALLED = all(importlib.util.find_spec(part.package) is not None for part in GEMMA_SPEC.parts)


@pytest.mark.real_model
@pytest.mark.skipif(not GEMMA_INSTALLED, reason=f"Gemma 3 270M packages missing: {GEMMA_SPEC.install_hint}")
def test_gemma3_loads_converted_and_continues_plain_text(real_cache_dir):
    model, tokenizer = load_target(GEMMA, dtype=torch.float32, cache_dir=real_cache_dir)
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("gemma3_text", 18, 640)
    assert "sliding_attention" in config.layer_types and not model.training
    assert json.loads(Path(real_cache_dir, GEMMA, MARKER_FILE).read_text())["sha256"] == GEMMA_SPEC.sha256
    assert not list(Path(real_cache_dir).glob(f".{GEMMA}.*"))  # no assembled GGUF or staging folder left
    assert tokenizer.chat_template is None  # a base model

    messages = [user("The capital of France is")]
    text = render_conversation(tokenizer, messages, add_generation_prompt=True)
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert prompt_ids[0] == tokenizer.bos_token_id
    with torch.no_grad():
        output = model.generate(torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False)
    reply = tokenizer.decode(output[0, len(prompt_ids) :], skip_special_tokens=True)
    assert output.shape[1] == len(prompt_ids) + 8 and "france" in (text + reply).lower() and reply.strip()

    input_ids, loss_mask = tokenize_conversation(tokenizer, [*messages, assistant(reply)])
    assert input_ids[: len(prompt_ids)] == prompt_ids
    assert tokenizer.decode([t for t, m in zip(input_ids, loss_mask) if m]) == reply


def test_bench_prompts_of_a_base_model_are_the_running_text_training_reads():
    from hf_dflash.bench.runner import chat_inputs

    tokenizer = make_char_tokenizer(chat_template=None)
    messages = [user("Once upon a time")]
    inputs = chat_inputs(tokenizer, messages, torch.device("cpu"))
    text = render_conversation(tokenizer, messages, add_generation_prompt=True)
    assert inputs["input_ids"][0].tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert inputs["attention_mask"].all()
    chat = make_char_tokenizer()  # with a chat template: its rendering with the assistant header
    expected = chat.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert torch.equal(chat_inputs(chat, messages, torch.device("cpu"))["input_ids"], expected["input_ids"])
