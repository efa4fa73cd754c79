"""`hf-dflash train --config`: a YAML config trains, resumes, and saves a loadable drafter."""

import json
from pathlib import Path

import pytest
import yaml
from huggingface_hub import ModelCard

from hf_dflash.checkpoints import load_drafter
from hf_dflash.models import load_any_target
from hf_dflash.trainer.datasets import TokenizedDataset
from hf_dflash.trainer.train import load_train_config, train_from_config
from tests.conftest import make_target
from tests.test_trainer import samples


def write_tokenized(folder, rows):
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "tokenized-00000.jsonl").open("w") as handle:
        for i, row in enumerate(rows):
            handle.write(json.dumps({"id": f"s{i}", **row}) + "\n")


@pytest.fixture
def run_config(tmp_path):
    target_dir = tmp_path / "target"
    make_target("llama").save_pretrained(target_dir)
    write_tokenized(tmp_path / "tokenized", samples(count=6))
    config = {
        "target": str(target_dir),
        "drafter": {"num_hidden_layers": 1, "num_target_features": 2},
        "data": {"tokenized": str(tmp_path / "tokenized"), "eval_samples": 2},
        "training": {
            "output_dir": str(tmp_path / "drafter"), "block_size": 4, "num_anchors": 4, "max_steps": 4,
            "per_device_train_batch_size": 2, "save_steps": 2, "report_to": [], "use_cpu": True,
            "eval_strategy": "steps", "eval_steps": 2, "logging_steps": 1,
        },
    }
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_train_from_yaml_saves_a_drafter_and_reports_tau(run_config):
    trainer = train_from_config(load_train_config(run_config))
    drafter = load_drafter(trainer.args.output_dir)
    assert drafter.config.block_size == 4 and drafter.config.target_layer_ids == [1, 3]
    assert any("eval_tau" in entry for entry in trainer.state.log_history)


def test_the_card_names_the_configured_target_not_its_cache_folder(run_config, monkeypatch):
    import hf_dflash.trainer.train as train_module

    def load_from_cache(name, dtype):  # like a known target: loaded from a cache folder
        target, tokenizer = load_any_target(name, dtype)
        target.config.name_or_path = "/root/.cache/hf_dflash/some-target"
        return target, tokenizer

    monkeypatch.setattr(train_module, "load_any_target", load_from_cache)
    config = load_train_config(run_config)
    config["training"].update(max_steps=1, eval_strategy="no", save_strategy="no")
    trainer = train_from_config(config)
    card = ModelCard.load(Path(trainer.args.output_dir) / "README.md")
    assert card.data.base_model == config["target"]


def test_a_rerun_resumes_from_the_last_checkpoint(run_config):
    first = train_from_config(load_train_config(run_config))
    early_checkpoint = Path(first.args.output_dir) / "checkpoint-2" / "trainer_state.json"
    written = early_checkpoint.stat().st_mtime_ns
    config = load_train_config(run_config)
    config["training"]["max_steps"] = 6
    second = train_from_config(config)
    assert second.state.global_step == 6
    assert (Path(first.args.output_dir) / "checkpoint-6").is_dir()
    assert early_checkpoint.stat().st_mtime_ns == written  # steps 1-4 were not trained (and saved) again


def test_bad_configs_and_data_are_named(tmp_path, run_config):
    bad = tmp_path / "bad.yaml"
    bad.write_text("target: x\nfoo: 1\n")
    with pytest.raises(ValueError, match=r"unknown section\(s\) \['foo'\]"):
        load_train_config(bad)
    write_tokenized(tmp_path / "broken", [{"input_ids": [1, 2, 3], "loss_mask": [0, 1]}])
    with pytest.raises(ValueError, match="tokenized-00000.jsonl:1: input_ids has 3 tokens but loss_mask has 2"):
        TokenizedDataset(tmp_path / "broken")
    write_tokenized(tmp_path / "big", [{"input_ids": [1, 500], "loss_mask": [0, 1]}])
    with pytest.raises(ValueError, match=r"outside \[0, 128\)"):
        TokenizedDataset(tmp_path / "big", vocab_size=128)


def test_cli_train_command(run_config, capsys):
    from hf_dflash.cli import main

    assert main(["train", "--config", str(run_config)]) == 0
    assert "Saved the trained drafter" in capsys.readouterr().out


def test_training_writes_record_and_a_dflash_card(run_config):
    from huggingface_hub import ModelCard

    trainer = train_from_config(load_train_config(run_config))
    output = Path(trainer.args.output_dir)
    record = json.loads((output / "training_record.json").read_text())
    assert record["data_sources"] == {"tokenized": 4} and record["hyperparameters"]["block_size"] == 4
    card = ModelCard.load(output / "README.md")
    assert {"dflash", "speculative-decoding", "block-diffusion"} <= set(card.data.tags)
    assert card.data.library_name == "transformers" and "No training record was provided" not in card.text
    assert "| block_size | 4 (anchor + 3 drafted tokens) |" in card.text
