"""Hub publishing: exported repo folders, model cards, training records and push (up to HTTP)."""

import json
import os
import re
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import huggingface_hub
import pytest
import torch
import yaml
from huggingface_hub import HfApi, ModelCard
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, TrainerState

from hf_dflash import DFlashDraftModel
from hf_dflash.checkpoints import (
    CUSTOM_GENERATE_FILE,
    detect_format,
    export_drafter,
    load_drafter,
    push_folder,
    save_hub,
)
from hf_dflash.checkpoints.hub import CUSTOM_GENERATE_SOURCE
from hf_dflash.cli import main
from hf_dflash.hub_cards import (
    REPO_ID_PLACEHOLDER,
    TrainingRecordCallback,
    load_benchmark,
    load_training_record,
    record_data_from_prepare_data,
    render_model_card,
)
from hf_dflash.hub_cards.card import EXPANSION_TAU
from hf_dflash.trainer import DFlashTrainingArguments
from tests.conftest import make_drafter, make_target

TARGET_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
REPO_ID = "hf-dflash-tests/tiny-dflash-drafter"
BENCHMARK = {
    "command": "python benchmarks/speed.py --sets gsm8k,humaneval",
    "machine": "1x NVIDIA H200, torch 2.13.0",
    "settings": {"dtype": "bfloat16", "max_new_tokens": 256, "temperature": 0.0},
    "sets": {
        "gsm8k": {
            "n": 40,
            "tau": 3.4127,
            "speedup": 2.05,
            "plain_tok_s": 51.3,
            "dflash_tok_s": 105.2,
            "identical": True,
        },
        "humaneval": {
            "n": 20,
            "tau": 4,
            "speedup": 2.625,
            "plain_tok_s": 50.0,
            "dflash_tok_s": 131.25,
            "identical": False,
        },
    },
}
RECORD = {
    "data_sources": {"sharegpt": 5000, "gsm8k": 3000},
    "hyperparameters": {"learning_rate": 0.0006, "lr_scheduler_type": "cosine", "block_size": 4, "num_anchors": 64},
    "training_time_s": 7512.3,
    "num_samples": 7890,
    "supervised_tokens": 1234567,
    "global_steps": 1200,
    "hardware": "1x NVIDIA H200",
    "final_metrics": {"loss": 1.9, "tau": 3.1},
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A 128-token word-level tokenizer with a chat template (ids 0/1/2 = pad/bos/eos, as the target)."""
    words = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant"]
    words += "Write a Python function that reverses string .".split()
    vocab = {word: i for i, word in enumerate(words)} | {f"w{i}": i for i in range(len(words), 128)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHAT_TEMPLATE,
    )


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hub_cards")


@pytest.fixture(scope="module")
def target_dir(work) -> Path:
    """The tiny target + tokenizer saved as a local Transformers folder (stands in for TARGET_ID)."""
    folder = work / "target"
    make_target("llama", seed=3).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def drafter_dir(work, target_dir) -> Path:
    return save_hub(make_drafter(make_target("llama", seed=3), block_size=4), work / "drafter")


@pytest.fixture(scope="module")
def inputs_dir(work) -> Path:
    folder = work / "inputs"
    folder.mkdir()
    (folder / "bench.json").write_text(json.dumps(BENCHMARK))
    (folder / "training_record.json").write_text(json.dumps(RECORD))
    return folder


@pytest.fixture(scope="module")
def exported(work, drafter_dir, inputs_dir) -> Path:
    return export_drafter(
        drafter_dir,
        work / "repo",
        TARGET_ID,
        benchmark_json=inputs_dir / "bench.json",
        training_record=inputs_dir / "training_record.json",
        official=True,
        repo_id=REPO_ID,
    )


@pytest.fixture(scope="module")
def bare(work, drafter_dir) -> Path:
    """Exported without benchmark, record, official folder or repo id."""
    return export_drafter(drafter_dir, work / "bare", TARGET_ID)


def python_blocks(card_text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", card_text, flags=re.DOTALL)


def runnable(snippet: str, target_dir: Path, repo_dir: Path) -> str:
    """The card's snippet with the Hub ids pointed at the local folders (nothing else changed)."""
    return snippet.replace(f'"{TARGET_ID}"', repr(str(target_dir))).replace(f'"{REPO_ID}"', repr(str(repo_dir)))


# The card's plain-Transformers snippet, run where hf_dflash cannot be imported, then checked against
# plain greedy decoding.
REMOTE_PRELUDE = """
import sys
sys.modules["hf_dflash"] = None
try:
    import hf_dflash
except ImportError:
    pass
else:
    raise SystemExit("hf_dflash is importable")
"""
REMOTE_CHECK = """
import torch
assert not any(name.startswith("hf_dflash") for name, module in sys.modules.items() if module)
loops = [module for name, module in sys.modules.items() if module and name.endswith("custom_generate.generate")]
drafters = [drafter for loop in loops for drafter in loop._DRAFTERS.values()]
assert [type(drafter).__name__ for drafter in drafters] == ["DFlashDraftModel"], drafters
assert not type(drafters[0]).__module__.startswith("hf_dflash"), type(drafters[0]).__module__
plain = target.generate(**inputs, max_new_tokens=128, do_sample=False)
assert torch.equal(out, plain), (out, plain)
print("REMOTE_OK", out.shape[1] - inputs["input_ids"].shape[1])
"""


@pytest.fixture(scope="module")
def remote_process(exported, target_dir, work):
    """Started early (Python + torch start-up takes seconds) and collected by the last test."""
    card = ModelCard.load(exported / "README.md")
    script = REMOTE_PRELUDE + runnable(python_blocks(card.text)[1], target_dir, exported) + REMOTE_CHECK
    cwd = work / "remote"
    cwd.mkdir()
    # One thread: tiny models run several times faster than with threads competing with pytest's.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(cwd / "modules"), "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    process = subprocess.Popen(
        [sys.executable, "-c", script], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    yield process
    if process.poll() is None:
        process.kill()
        process.communicate()


# ---------------------------------------------------------------- the repo folder


def test_exported_folder(exported, drafter_dir, remote_process):
    names = {p.name for p in exported.iterdir()}
    assert names == {
        "config.json",
        "configuration_dflash.py",
        "modeling_dflash.py",
        "model.safetensors",
        "README.md",
        "benchmark.json",
        "training_record.json",
        "official",
        "custom_generate",
    }
    assert (exported / CUSTOM_GENERATE_FILE).read_text() == CUSTOM_GENERATE_SOURCE.read_text()
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "dflash"
    assert config["auto_map"] == {
        "AutoConfig": "configuration_dflash.DFlashConfig",
        "AutoModel": "modeling_dflash.DFlashDraftModel",
    }
    assert json.loads((exported / "benchmark.json").read_text()) == BENCHMARK
    assert json.loads((exported / "training_record.json").read_text()) == RECORD
    source, written = load_file(str(drafter_dir / "model.safetensors")), load_file(str(exported / "model.safetensors"))
    assert sorted(source) == sorted(written) and all(torch.equal(source[k], written[k]) for k in source)


def test_official_subfolder_loads(exported, drafter_dir):
    official = exported / "official"
    assert {p.name for p in official.iterdir()} == {
        "config.json",
        "model.safetensors",
        "configuration_dflash.py",
        "modeling_dflash.py",
    }  # remote code: AutoModel.from_pretrained(that_folder, trust_remote_code=True) is the drafter
    assert detect_format(official) == "official"
    config = json.loads((official / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert config["dflash_config"] == {"mask_token_id": 127, "target_layer_ids": [1, 3], "block_size": 4}
    loaded, reference = load_drafter(official), load_drafter(drafter_dir)
    assert isinstance(loaded, DFlashDraftModel)
    reference_state = reference.state_dict()
    assert all(torch.equal(tensor, reference_state[key]) for key, tensor in loaded.state_dict().items())


def test_export_validates_before_writing(work, drafter_dir, exported):
    out = work / "never"
    bad = {**BENCHMARK, "sets": {"gsm8k": {"n": 40, "speedup": 2.0}}}
    with pytest.raises(ValueError, match=r"sets\.gsm8k\.tau.*sets\.gsm8k\.plain_tok_s") as error:
        export_drafter(drafter_dir, out, TARGET_ID, benchmark_json=bad)
    assert "sets.gsm8k.identical" in str(error.value) and "sets.gsm8k.n," not in str(error.value)
    with pytest.raises(ValueError, match="training_time_s"):
        no_time = {k: v for k, v in RECORD.items() if k != "training_time_s"}
        export_drafter(drafter_dir, out, TARGET_ID, training_record=no_time)
    with pytest.raises(ValueError, match="target_id='SmolLM2' is not a Hub repository id"):
        export_drafter(drafter_dir, out, "SmolLM2")
    assert not out.exists()
    with pytest.raises(ValueError, match="not empty"):
        export_drafter(drafter_dir, exported, TARGET_ID)


# ---------------------------------------------------------------- the card


def front_matter(path: Path) -> dict:
    text = path.read_text()
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n", 2)[1])


def test_card_metadata(exported):
    card = ModelCard.load(exported / "README.md")
    assert card.data.base_model == TARGET_ID
    assert card.data.library_name == "transformers"
    assert card.data.tags == ["dflash", "speculative-decoding", "block-diffusion", "custom_generate"]
    assert card.data.pipeline_tag == "text-generation"
    assert card.data.license == "apache-2.0"
    assert card.data.datasets is None  # the record's data_sources are local names, not Hub dataset ids
    assert front_matter(exported / "README.md") == {
        "base_model": TARGET_ID,
        "library_name": "transformers",
        "license": "apache-2.0",
        "pipeline_tag": "text-generation",
        "tags": ["dflash", "speculative-decoding", "block-diffusion", "custom_generate"],
    }


def test_card_numbers_equal_the_benchmark_and_record(exported):
    text = ModelCard.load(exported / "README.md").text
    table = text.split("| set | n | τ | speed-up | plain tok/s | DFlash tok/s | identical |\n")[1].split("\n\n")[0]
    assert len(table.splitlines()) == 1 + len(BENCHMARK["sets"])
    for name, numbers in BENCHMARK["sets"].items():
        rows = [line for line in table.splitlines() if line.startswith(f"| {name} | ")]
        assert len(rows) == 1, rows
        cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
        assert int(cells[1]) == numbers["n"]
        for cell, key in zip(cells[2:6], ("tau", "speedup", "plain_tok_s", "dflash_tok_s"), strict=True):
            assert float(cell) == numbers[key], (name, key, cell)
        assert cells[6] == ("yes" if numbers["identical"] else "no")
    assert f"`{BENCHMARK['command']}`" in text and BENCHMARK["machine"] in text
    assert "- `max_new_tokens`: `256`" in text and "- `dtype`: `bfloat16`" in text
    assert "7890 samples, 1234567 supervised tokens" in text
    assert "2 h 05 min on 1x NVIDIA H200, 1200 optimizer steps" in text
    assert "| sharegpt | 5000 |" in text and "| gsm8k | 3000 |" in text
    assert "| `learning_rate` | `0.0006` |" in text and "| `tau` | 3.1 |" in text
    # drafter config and serving flags
    assert "| block_size | 4 (anchor + 3 drafted tokens) |" in text
    assert "`[1, 3]`" in text and "| mask_token_id | 127 |" in text and "| drafter layers | 2 " in text
    assert '"num_speculative_tokens": 3' in text and "--speculative-num-draft-tokens 4" in text
    assert f'hf download {REPO_ID} --include "official/*"' in text and "--speculative-algorithm DFLASH" in text


def test_card_without_benchmark_or_record_says_so(bare):
    text = (bare / "README.md").read_text()
    assert "No benchmark results were provided" in text
    assert "No training record was provided" in text
    assert "tok/s" not in text and "| set |" not in text and "| hyper-parameter |" not in text
    assert "datasets" not in front_matter(bare / "README.md")
    assert "hf-dflash convert" in text and "official/" not in text  # no official folder to download
    assert {p.name for p in bare.iterdir()} == {
        "config.json",
        "configuration_dflash.py",
        "modeling_dflash.py",
        "model.safetensors",
        "README.md",
        "custom_generate",
    }


@pytest.fixture
def one_thread():
    """Tiny models run several times faster on one thread (the remote-code subprocess runs meanwhile)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_card_snippet_with_our_package(exported, target_dir, one_thread):
    """The card's first snippet (import hf_dflash; no speculation_type) runs and is lossless."""
    namespace = {}
    exec(runnable(python_blocks((exported / "README.md").read_text())[0], target_dir, exported), namespace)
    drafter, target, inputs = namespace["drafter"], namespace["target"], namespace["inputs"]
    assert isinstance(drafter, DFlashDraftModel)
    assert drafter.last_acceptance.mean_acceptance_length >= 1
    plain = target.generate(**inputs, max_new_tokens=128, do_sample=False)
    assert torch.equal(namespace["out"], plain)
    assert plain.shape[1] - inputs["input_ids"].shape[1] >= 8


@pytest.mark.parametrize(
    "layers, expected",
    [
        (dict(), r"\| attention \| 2 full-attention layers: bidirectional inside the block, all context \|"),
        (
            dict(layer_types=["sliding_attention", "full_attention"], sliding_window=64),
            r"1 sliding-window layer \(window 64\): causal inside the block.*SpecForge.*sliding_window_non_causal: false",
        ),
        (
            dict(
                layer_types=["sliding_attention", "sliding_attention"],
                sliding_window=64,
                sliding_window_non_causal=True,
            ),
            r"2 sliding-window layers \(window 64\): bidirectional inside the block.*sliding_window_non_causal: true",
        ),
    ],
    ids=["full", "sliding_causal", "sliding_bidirectional"],
)
def test_card_states_the_attention_semantics(layers, expected):
    """Issue #13 A5: serving engines differ on sliding layers; the card says which ones these weights need."""
    drafter = make_drafter(make_target("llama"), **layers)
    card = render_model_card(drafter.config, TARGET_ID)
    assert re.search(expected, card.text), card.text


def test_a_dflash2_card_names_its_convolutions_and_selector():
    """A DFlash2 drafter's card says what it adds to DFlash; a DFlash drafter's card has no such row."""
    from hf_dflash.trainer.upgrade import dflash2_from_dflash

    drafter = make_drafter(make_target("llama"))
    assert "| DFlash2 |" not in render_model_card(drafter.config, TARGET_ID).text
    upgraded = dflash2_from_dflash(drafter, conv_kernel_size=2, conv_group_size=8, selector_rank=6, selector_top_k=3)
    text = render_model_card(upgraded.config, TARGET_ID).text
    assert re.search(r"\| DFlash2 \| two-tap grouped convolutions \(kernel 2, groups of 8\).*rank 6.*top-3", text), text


def test_the_card_names_the_engine_command_each_drafter_kind_has():
    """A pruned DFlash drafter's convert command names its target (the official copy holds that head's rows); a
    pruned DFlash2 drafter has no engine layout as trained (save_official refuses it): its card says so, and gives
    the expanding convert with what expansion did to acceptance; a DFlash2 card has no SGLang command."""
    from hf_dflash.trainer.upgrade import dflash2_from_dflash

    target = make_target("llama")
    text = render_model_card(make_drafter(target).config, TARGET_ID).text
    assert "--to official\n" in text and "--target" not in text
    pruned = make_drafter(target, draft_vocab_size=16)
    text = render_model_card(pruned.config, TARGET_ID).text
    assert f"--to official --target {TARGET_ID}\n" in text and '"method": "dflash"' in text
    pruned2 = dflash2_from_dflash(pruned, conv_kernel_size=2, conv_group_size=8, selector_rank=6, selector_top_k=3)
    text = render_model_card(pruned2.config, TARGET_ID).text
    assert "has no engine layout as trained" in text and "--to official --expand-vocabulary\n" in text
    assert EXPANSION_TAU in text and "vllm serve" in text and "sglang" not in text


def test_template_is_package_data():
    assert resources.files("hf_dflash.hub_cards").joinpath("template.md").is_file()
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()  # (no tomllib on Python 3.10)
    assert '[tool.setuptools.package-data]\n"hf_dflash.hub_cards" = ["*.md"]' in pyproject


# ---------------------------------------------------------------- schemas and the training record


def test_benchmark_validation_names_fields(tmp_path):
    with pytest.raises(ValueError, match=r"missing field\(s\) command, machine, settings, sets"):
        load_benchmark({})
    wrong = {**BENCHMARK, "machine": 3, "sets": {"mt": {**BENCHMARK["sets"]["gsm8k"], "n": 4.5, "identical": "yes"}}}
    with pytest.raises(ValueError, match=r"machine \(a string.*sets\.mt\.n \(an? integer.*sets\.mt\.identical"):
        load_benchmark(wrong)
    with pytest.raises(ValueError, match="at least one benchmark set"):
        load_benchmark({**BENCHMARK, "sets": {}})
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="broken.json is not valid JSON"):
        load_benchmark(tmp_path / "broken.json")
    assert load_benchmark({**BENCHMARK, "extra": 1})["extra"] == 1


def test_training_record_validation():
    assert load_training_record(RECORD) == RECORD
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['learning_rate'\]"):
        load_training_record({**RECORD, "learning_rate": 1e-3})
    with pytest.raises(ValueError, match=r"data_sources\.gsm8k \(a sample count"):
        load_training_record({**RECORD, "data_sources": {"gsm8k": -1}})
    with pytest.raises(ValueError, match=r"missing field\(s\) hyperparameters"):
        load_training_record({k: v for k, v in RECORD.items() if k != "hyperparameters"})
    averaged = {**RECORD, "averaged_from": [{"path": "a", "weights_sha256": "12ab"}, {"path": "b"}]}
    assert load_training_record(averaged) == averaged
    with pytest.raises(ValueError, match=r"averaged_from"):
        load_training_record({**RECORD, "averaged_from": ["a"]})


def test_a_card_says_its_weights_are_a_mean():
    from hf_dflash.hub_cards import render_model_card
    from tests.conftest import make_drafter, make_target

    config = make_drafter(make_target("llama"), block_size=4).config
    sources = [{"path": "out/start", "weights_sha256": "aa11"}, {"path": "out/cycle", "weights_sha256": "bb22"}]
    text = render_model_card(config, TARGET_ID, training_record={**RECORD, "averaged_from": sources}).text
    assert "- Weights: the mean of `out/start` (weights sha256 `aa11`) and `out/cycle` (weights sha256 `bb22`)." in text


def test_training_record_callback(tmp_path, drafter_dir):
    data_dir = tmp_path / "data"
    (data_dir / "corpus").mkdir(parents=True)
    (data_dir / "tokenized").mkdir()
    per_source = {
        "gsm8k": {"loaded": 9, "duplicates": 0, "contaminated": 1, "kept": 8, "selected": 6},
        "math": {"loaded": 2, "duplicates": 2, "contaminated": 0, "kept": 0, "selected": 0},
    }
    (data_dir / "corpus" / "summary.json").write_text(json.dumps({"per_source": per_source}))
    (data_dir / "tokenized" / "summary.json").write_text(json.dumps({"kept": 5, "supervised_tokens": 640}))
    data = record_data_from_prepare_data(data_dir)
    assert data == {"data_sources": {"gsm8k": 6}, "num_samples": 5, "supervised_tokens": 640}
    with pytest.raises(ValueError, match="data_sources"):
        TrainingRecordCallback(data_sources={"gsm8k": "six"})

    args = DFlashTrainingArguments(output_dir=str(tmp_path / "run"), block_size=4, num_anchors=8, report_to=[])
    state = TrainerState(global_step=2, log_history=[{"loss": 2.0, "tau": 1.2}, {"loss": 1.5, "tau": 1.4}])
    callback = TrainingRecordCallback(**data, hardware="CPU")
    callback.on_train_begin(args, state, None)
    callback.on_train_end(args, state, None)
    record = load_training_record(tmp_path / "run" / "training_record.json")
    assert record["data_sources"] == {"gsm8k": 6} and record["hardware"] == "CPU" and record["global_steps"] == 2
    assert record["final_metrics"] == {"loss": 1.5, "tau": 1.4}
    hyper = record["hyperparameters"]
    assert hyper["block_size"] == 4 and hyper["num_anchors"] == 8 and hyper["learning_rate"] == 6e-4
    assert hyper["lr_scheduler_type"] == "cosine" and hyper["global_batch_size"] == args.per_device_train_batch_size
    assert 0 <= record["training_time_s"] < 60
    record_file = tmp_path / "run" / "training_record.json"
    out = export_drafter(drafter_dir, tmp_path / "repo", TARGET_ID, training_record=record_file)
    assert "| gsm8k | 6 |" in (out / "README.md").read_text()


def test_the_training_time_of_a_resumed_run_adds_the_time_its_checkpoint_holds(tmp_path, monkeypatch):
    """A run trained 100 s, saved, then resumed for 50 s records 150 s; a checkpoint from before the time was saved
    (no state of this callback) counts from zero and gets room for the callback's state."""
    import hf_dflash.hub_cards.record as record_module

    clock = [1000.0]
    monkeypatch.setattr(record_module.time, "perf_counter", lambda: clock[0])
    args = DFlashTrainingArguments(output_dir=str(tmp_path / "run"), block_size=4, num_anchors=8, report_to=[])
    first = TrainingRecordCallback({"chats": 8})
    first.on_train_begin(args, TrainerState(), None)
    clock[0] += 100.0
    saved = first.state()
    assert saved == {"args": {"data_sources": {"chats": 8}}, "attributes": {"earlier_training_time_s": 100.0}}

    resumed = TrainingRecordCallback(**saved["args"])
    state = TrainerState(global_step=750, stateful_callbacks={"TrainingRecordCallback": saved})
    resumed.on_train_begin(args, TrainerState(), None)  # Trainer loads the checkpoint's state after this call
    resumed.on_step_begin(args, state, None)
    clock[0] += 50.0
    resumed.on_step_begin(args, state, None)  # read once
    resumed.on_train_end(args, state, None)
    assert load_training_record(tmp_path / "run" / "training_record.json")["training_time_s"] == 150.0

    old = TrainerState(global_step=750)  # a checkpoint written before this callback saved its time
    older = TrainingRecordCallback({"chats": 8})
    older.on_train_begin(args, TrainerState(), None)
    older.on_step_begin(args, old, None)
    clock[0] += 20.0
    assert older.training_time_s() == 20.0 and "TrainingRecordCallback" in old.stateful_callbacks


# ---------------------------------------------------------------- CLI and push


def test_cli_export_bf16(tmp_path, drafter_dir, inputs_dir, capsys):
    out = tmp_path / "repo"
    argv = [
        "export",
        str(drafter_dir),
        str(out),
        "--target-id",
        TARGET_ID,
        "--official",
        "--dtype",
        "bfloat16",
        "--benchmark",
        str(inputs_dir / "bench.json"),
        "--training-record",
        str(inputs_dir / "training_record.json"),
    ]
    assert main(argv) == 0
    for weights in (out / "model.safetensors", out / "official" / "model.safetensors"):
        assert {tensor.dtype for tensor in load_file(str(weights)).values()} == {torch.bfloat16}
    assert "| weights | bfloat16 |" in (out / "README.md").read_text()
    assert load_drafter(out).dtype == torch.bfloat16

    (inputs_dir / "bad.json").write_text(json.dumps({**BENCHMARK, "sets": {"gsm8k": {"n": 1}}}))
    capsys.readouterr()
    assert (
        main(
            [
                "export",
                str(drafter_dir),
                str(tmp_path / "x"),
                "--target-id",
                TARGET_ID,
                "--benchmark",
                str(inputs_dir / "bad.json"),
            ]
        )
        == 2
    )
    assert "sets.gsm8k.tau" in capsys.readouterr().err


@pytest.fixture
def fake_hub(monkeypatch):
    calls = []

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", self.token, repo_id, kwargs))
        return f"https://huggingface.co/{repo_id}"

    def create_commit(self, **kwargs):
        calls.append(("create_commit", self.token, kwargs))

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    return calls


def test_push_calls_the_hub_api(bare, tmp_path, fake_hub, monkeypatch, capsys):
    folder = Path(shutil.copytree(bare, tmp_path / "repo"))
    assert REPO_ID_PLACEHOLDER in (folder / "README.md").read_text()
    url = push_folder(folder, REPO_ID, token="hf_fake")
    assert url == f"https://huggingface.co/{REPO_ID}"
    (_, token, repo_id, create_kwargs), (_, upload_token, upload_kwargs) = fake_hub
    assert token == upload_token == "hf_fake" and repo_id == REPO_ID
    assert create_kwargs["private"] is True and create_kwargs["exist_ok"] is True
    assert upload_kwargs["repo_id"] == REPO_ID and upload_kwargs["repo_type"] == "model"
    operations = {operation.path_in_repo: operation for operation in upload_kwargs["operations"]}
    assert set(operations) == {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    card = (folder / "README.md").read_text()  # the snippets now name the real repo, uploaded and on disk
    assert REPO_ID_PLACEHOLDER not in card and f'AutoModel.from_pretrained("{REPO_ID}"' in card
    assert operations["README.md"].path_or_fileobj == card.encode("utf-8")

    fake_hub.clear()
    with pytest.warns(UserWarning, match="does not mention other-org/other-name"):
        push_folder(folder, "other-org/other-name", token="hf_fake")
    fake_hub.clear()
    monkeypatch.setenv("HF_TOKEN", "hf_from_env")
    assert main(["push", str(folder), "--repo-id", REPO_ID, "--public"]) == 0
    assert fake_hub[0][1] == "hf_from_env" and fake_hub[0][3]["private"] is False
    assert "public" in capsys.readouterr().out


def folder_snapshot(folder: Path) -> dict:
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()
    }


def http_error(status: int):
    import httpx2 as httpx  # huggingface_hub 2.x raises with httpx2 responses
    from huggingface_hub.errors import HfHubHTTPError

    response = httpx.Response(status, request=httpx.Request("POST", "https://huggingface.co/api/repos/create"))
    return HfHubHTTPError(f"{status} Client Error: Unauthorized for url", response=response)


@pytest.mark.parametrize("failing", ["create_repo", "upload"])
def test_a_failed_push_leaves_the_folder_unchanged(bare, tmp_path, fake_hub, monkeypatch, capsys, failing):
    """Issue #13 B9: a bad token (401) used to leave the card rewritten with the repo id."""
    folder = Path(shutil.copytree(bare, tmp_path / "repo"))
    before = folder_snapshot(folder)

    def refuse(self, *args, **kwargs):
        raise http_error(401)

    monkeypatch.setattr(HfApi, "create_repo" if failing == "create_repo" else "create_commit", refuse)
    with pytest.raises(ValueError, match=r"refused.*401.*hf auth login"):
        push_folder(folder, REPO_ID, token="hf_bad")
    assert main(["push", str(folder), "--repo-id", REPO_ID]) == 2
    assert "hf-dflash push: error:" in capsys.readouterr().err
    assert folder_snapshot(folder) == before
    assert REPO_ID_PLACEHOLDER in (folder / "README.md").read_text()


def test_push_without_token_explains_login(bare, tmp_path, fake_hub, monkeypatch):
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    assert huggingface_hub.get_token() is None
    with pytest.raises(ValueError, match=r"No Hugging Face token.*hf auth login.*HF_TOKEN"):
        push_folder(bare, REPO_ID)
    assert fake_hub == []
    with pytest.raises(ValueError, match="lacks"):
        push_folder(tmp_path, REPO_ID, token="hf_fake")


# ---------------------------------------------------------------- remote code, last (collects the subprocess)


def test_card_snippet_with_plain_transformers_in_subprocess(remote_process):
    """The card's plain-Transformers snippet (custom_generate=<the repo>, trust_remote_code=True) runs where
    hf_dflash cannot be imported, through the repo's own DFlash loop and drafter, and generates exactly plain
    greedy's tokens."""
    stdout, stderr = remote_process.communicate(timeout=120)
    assert remote_process.returncode == 0, stderr[-3000:]
    generated = int(stdout.split("REMOTE_OK")[1].split()[0])
    assert generated >= 8, stdout


def test_card_datasets_are_the_hub_ids_the_record_names():
    drafter = make_drafter(make_target(), block_size=4)
    record = {**RECORD, "datasets": ["openai/gsm8k"]}
    card = render_model_card(drafter.config, TARGET_ID, training_record=record)
    assert card.data.datasets == ["openai/gsm8k"]
    assert render_model_card(drafter.config, TARGET_ID, training_record=RECORD).data.datasets is None


def test_a_refused_export_leaves_no_half_written_folder(tmp_path, capsys):
    """Issue 53 item 6: `export --official` of a drafter the official format cannot hold (DFlash2 with a draft
    vocabulary) used to leave config, weights and remote code in OUT_DIR, which blocked a re-run. The export is
    written beside OUT_DIR and moved in at the end: a refusal leaves OUT_DIR as it was (absent, or empty)."""
    from tests.test_dflash2_serving import dflash2_drafter

    drafter = save_hub(dflash2_drafter(make_target("llama"), draft_vocab_size=24), tmp_path / "drafter")
    for out in (tmp_path / "new" / "repo", tmp_path / "empty"):
        if out.name == "empty":
            out.mkdir()
        argv = ["export", str(drafter), str(out), "--target-id", TARGET_ID, "--official"]
        assert main(argv) == 2
        assert "has no official layout" in capsys.readouterr().err
        assert (list(out.iterdir()) == []) if out.name == "empty" else not out.parent.exists()  # as it was
        assert [path.name for path in tmp_path.iterdir() if path.name.startswith(".")] == []  # nothing beside it
        assert main(argv[:-1]) == 0  # the re-run without --official goes ahead
        assert (out / "config.json").is_file() and not (out / "official").exists()
        assert [path.name for path in out.parent.iterdir() if path.name.startswith(".")] == []
