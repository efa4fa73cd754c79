"""`hf-dflash train --config`: a YAML config trains, resumes, and saves a loadable drafter."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
import yaml
from huggingface_hub import ModelCard

from hf_dflash.checkpoints import load_drafter
from hf_dflash.data.tokenized import TokenizedDataset
from hf_dflash.hub_cards import render_model_card
from hf_dflash.targets import load_any_target
from hf_dflash.trainer.train import load_train_config, train_from_config
from tests.helpers.training import write_tokenized

SHIPPED = Path(__file__).resolve().parents[1] / "models" / "smollm2-135m-instruct-dflash"


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


# ---------------------------------------------------------------- the YAML is validated up front (issue #13 B3)


def edited(run_config, tmp_path, edit, name="edited.yaml"):
    config = yaml.safe_load(run_config.read_text())
    edit(config)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c["drafter"].update(num_layers=2), r"drafter\.num_layers: unknown key.*num_hidden_layers"),
        (lambda c: c["data"].update(tokenised="x"), r"data\.tokenised: unknown key.*tokenized"),
        (lambda c: c["training"].update(learning_rte=1e-3), r"training\.learning_rte: unknown key.*learning_rate"),
        (lambda c: c.update(lora={"rank": 8}), r"lora\.rank: unknown key.*\br\b"),
        (
            lambda c: c["training"].update(learning_rate="fast"),
            r"training\.learning_rate: expected float, got str 'fast'",
        ),
        (lambda c: c["training"].update(block_size="4"), r"training\.block_size: expected int, got str '4'"),
        (lambda c: c["training"].update(block_size=True), r"training\.block_size: expected int, got bool"),
        (lambda c: c["drafter"].update(num_hidden_layers=2.5), r"drafter\.num_hidden_layers: expected int, got float"),
        (lambda c: c["drafter"].update(target_layer_ids=[1, "x"]), r"drafter\.target_layer_ids: expected list\[int\]"),
        (lambda c: c["data"].update(eval_samples="2"), r"data\.eval_samples: expected int, got str"),
        (lambda c: c["data"].pop("tokenized"), r"data\.tokenized: missing \(expected str\)"),
        (lambda c: c["training"].pop("output_dir"), r"training\.output_dir: missing \(expected str\)"),
        (lambda c: c.pop("data"), r"data: missing section"),
        (lambda c: c.update(drafter=[1, 2]), r"drafter: expected a mapping"),
        (lambda c: c.update(target_dtype="float8"), r"target_dtype: expected one of"),
        (lambda c: c["drafter"].update(init_from="x"), r"drafter\.num_hidden_layers: ignored with drafter\.init_from"),
        (
            lambda c: c["drafter"].update(upgrade_to_dflash2={"selector_rank": 8}),
            r"drafter\.upgrade_to_dflash2: upgrades the drafter of drafter\.init_from; set init_from",
        ),
        (
            lambda c: c.update(drafter={"init_from": "x", "upgrade_to_dflash2": {"rank": 8, "selector_top_k": 0}}),
            r"upgrade_to_dflash2\.rank: unknown; allowed: conv_kernel_size(.|\n)*selector_top_k: expected an int >= 1",
        ),
    ],
    ids=[
        "drafter_typo",
        "data_typo",
        "training_typo",
        "lora_typo",
        "float",
        "int_as_str",
        "bool_as_int",
        "float_as_int",
        "list_item",
        "data_int",
        "no_tokenized",
        "no_output_dir",
        "no_data",
        "not_mapping",
        "dtype",
        "init_from_with_sizes",
        "upgrade_without_init_from",
        "upgrade_fields",
    ],
)
def test_each_config_problem_is_named_with_section_key_and_type(run_config, tmp_path, edit, message):
    with pytest.raises(ValueError, match=message):
        load_train_config(edited(run_config, tmp_path, edit))


def test_a_drafter_upgraded_to_dflash2_trains_its_selector(run_config, tmp_path):
    """init_from + upgrade_to_dflash2: the saved drafter is DFlash2 with the given sizes, its DFlash weights
    and selector trained, and the log has the selector's metrics."""
    first = train_from_config(load_train_config(run_config))
    upgrade = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 5}

    def edit(config):
        config["drafter"] = {"init_from": config["training"]["output_dir"], "upgrade_to_dflash2": upgrade}
        config["training"]["output_dir"] = str(tmp_path / "dflash2")

    second = train_from_config(load_train_config(edited(run_config, tmp_path, edit)))
    saved = load_drafter(tmp_path / "dflash2")
    assert saved.config.is_dflash2 and saved.candidate_selector.top_k == 5 and saved.config.selector_rank == 4
    assert saved.candidate_selector.hidden_projection.weight.abs().sum() > 0  # moved off identity (0)
    assert any("selector_acc" in entry for entry in second.state.log_history)
    assert not any("selector_acc" in entry for entry in first.state.log_history)
    # the record (and so the card) says which weights the run continued from
    start = Path(first.args.output_dir)
    record = json.loads((tmp_path / "dflash2" / "training_record.json").read_text())
    assert record["init_from"] == {
        "path": str(start),
        "weights_sha256": hashlib.sha256((start / "model.safetensors").read_bytes()).hexdigest(),
        "upgrade_to_dflash2": upgrade,
    }
    assert "init_from" not in json.loads((start / "training_record.json").read_text())
    card = str(render_model_card(saved.config, target_id="t/t", training_record=record))
    assert f"Continued from `{start}` (weights sha256 `{record['init_from']['weights_sha256']}`)" in card


def test_all_problems_are_reported_at_once_and_the_cli_prints_no_traceback(run_config, tmp_path, capsys):
    from hf_dflash.cli import main

    def three_problems(config):
        config["drafter"]["num_layers"] = 2
        config["training"]["learning_rate"] = "fast"
        config["data"].pop("tokenized")

    path = edited(run_config, tmp_path, three_problems)
    with pytest.raises(ValueError) as error:
        load_train_config(path)
    lines = [line for line in str(error.value).splitlines() if line.startswith("  - ")]
    assert len(lines) == 3, error.value
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-dflash train: error:") and "Traceback" not in err and "drafter.num_layers" in err


def test_yaml_exponent_floats_are_accepted(run_config, tmp_path):
    """PyYAML reads `6e-4` (no dot) as a string; it is the float the user meant."""
    path = tmp_path / "exp.yaml"
    path.write_text(run_config.read_text().replace("training:\n", "training:\n  learning_rate: 6e-4\n"))
    assert load_train_config(path)["training"]["learning_rate"] == pytest.approx(6e-4)


def test_a_key_repeated_in_the_yaml_is_refused_by_name(run_config, tmp_path, capsys):
    """Issue 36: PyYAML keeps the last of two equal keys without a word (the run trained with either value)."""
    from hf_dflash.cli import main

    path = tmp_path / "twice.yaml"
    path.write_text(run_config.read_text().replace("training:\n", "training:\n  max_steps: 1\n"))
    with pytest.raises(
        ValueError, match=r"twice\.yaml: key 'max_steps' appears twice in one mapping \(lines \d+ and \d+\)"
    ):
        load_train_config(path)
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-dflash train: error:") and "'max_steps' appears twice" in err and "Traceback" not in err
    top = tmp_path / "top.yaml"
    top.write_text(run_config.read_text() + "target_dtype: bfloat16\n")
    with pytest.raises(ValueError, match=r"key 'target_dtype' appears twice"):
        load_train_config(top)
    merged = (
        tmp_path / "merged.yaml"
    )  # a merge key may still be overridden, and equal keys in sibling mappings are fine
    merged.write_text("base: &base {a: 1, b: 2}\nover: {<<: *base, a: 3}\nother: {a: 4}\n")
    from hf_dflash.trainer.train import read_yaml

    assert read_yaml(merged)["over"] == {"a": 3, "b": 2}


# ---------------------------------------------------------------- interrupted saves, finished runs (B4, B5)


def test_an_interrupted_checkpoint_save_is_skipped_on_resume(run_config, monkeypatch, capsys):
    """SIGINT while checkpoint-4 is written leaves its weights without trainer_state.json."""
    from hf_dflash.trainer.trainer import DFlashTrainer

    original = DFlashTrainer._save_optimizer_and_scheduler

    def interrupted_at_step_4(self, output_dir):
        if output_dir.endswith("checkpoint-4"):
            raise KeyboardInterrupt
        return original(self, output_dir)

    config = load_train_config(run_config)
    config["training"]["eval_strategy"] = "no"
    monkeypatch.setattr(DFlashTrainer, "_save_optimizer_and_scheduler", interrupted_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        train_from_config(config)
    output = Path(config["training"]["output_dir"])
    assert (output / "checkpoint-4" / "model.safetensors").is_file()
    assert not (output / "checkpoint-4" / "trainer_state.json").exists()
    monkeypatch.setattr(DFlashTrainer, "_save_optimizer_and_scheduler", original)
    capsys.readouterr()
    trainer = train_from_config(config)
    out = capsys.readouterr().out
    assert "checkpoint-4" in out and "incomplete" in out and "resuming from" in out and "checkpoint-2" in out
    assert trainer.state.global_step == 4
    assert load_drafter(output).config.block_size == 4


def test_rerunning_a_finished_run_leaves_it_alone(run_config, capsys):
    config = load_train_config(run_config)
    first = train_from_config(config)
    output = Path(first.args.output_dir)
    written = {p.name: p.stat().st_mtime_ns for p in output.iterdir() if p.is_file()}
    capsys.readouterr()
    assert train_from_config(load_train_config(run_config)) is None
    assert "Training already finished" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in output.iterdir() if p.is_file()} == written
    assert not (output / "checkpoint-5").exists()


def test_cli_says_a_finished_run_is_left_alone(run_config, capsys):
    from hf_dflash.cli import main

    assert main(["train", "--config", str(run_config)]) == 0
    capsys.readouterr()
    assert main(["train", "--config", str(run_config)]) == 0
    out = capsys.readouterr().out
    assert "Training already finished" in out and "Saved the trained drafter" not in out


# ---------------------------------------------------------------- training.seed seeds the drafter (B6)


def test_training_seed_seeds_the_drafter_initialisation(run_config, tmp_path):
    def weights(seed, name):
        config = load_train_config(run_config)
        config["training"].update(
            output_dir=str(tmp_path / name),
            seed=seed,
            learning_rate=0.0,
            max_steps=1,
            eval_strategy="no",
            save_strategy="no",
        )
        train_from_config(config)
        return load_drafter(tmp_path / name).state_dict()

    first, again, other = weights(7, "a"), weights(7, "b"), weights(8, "c")
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not all(torch.equal(first[key], other[key]) for key in first)


def test_evaluation_logs_the_served_tau_estimate_beside_the_uniform_one(run_config):
    trainer = train_from_config(load_train_config(run_config))
    evaluations = [entry for entry in trainer.state.log_history if "eval_served_tau" in entry]
    assert evaluations and all(
        entry["eval_served_tau"] >= 1 and entry["eval_all_anchor_tau"] >= 1 for entry in evaluations
    )


@pytest.mark.parametrize(
    "path", sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml")), ids=lambda p: p.name
)
def test_committed_training_configs_are_valid(path):
    config = load_train_config(path)  # every key and type checked (config_schema)
    assert config["training"]["output_dir"].startswith("out/")  # runs write to the ignored out/ folder


def test_training_refuses_an_output_dir_it_did_not_make(run_config, tmp_path):
    """Issue 25 B2: a copy of a shipped drafter folder as output_dir was overwritten (weights, config, card,
    record) and kept its benchmark.json beside the new weights; now refused before anything loads."""
    import shutil

    config = load_train_config(run_config)
    copy = tmp_path / "copy-of-shipped"
    shutil.copytree(SHIPPED, copy, ignore=shutil.ignore_patterns("model.safetensors"))
    (copy / "model.safetensors").write_bytes(b"the shipped weights")
    before = {path: path.read_bytes() for path in copy.rglob("*") if path.is_file()}
    config["training"]["output_dir"] = str(copy)
    with pytest.raises(ValueError, match=r"was not made by hf-dflash train \(it holds README.md, benchmark.json"):
        train_from_config(config)
    assert {path: path.read_bytes() for path in copy.rglob("*") if path.is_file()} == before


def test_training_locks_its_output_dir_and_marks_it_as_its_own(run_config, tmp_path):
    from hf_dflash.folder_lock import FolderLockedError, folder_lock

    config = load_train_config(run_config)
    config["training"].update(max_steps=1, eval_strategy="no", save_strategy="no")
    out = Path(config["training"]["output_dir"])
    with folder_lock(out):  # another run is training into it
        with pytest.raises(FolderLockedError, match="another process is writing to"):
            train_from_config(config)
    train_from_config(config)
    assert json.loads((out / "training_started.json").read_text())["made_by"] == "hf-dflash train"
    assert not (out / ".hf-dflash.lock").exists()
    config["training"]["max_steps"] = 2  # its own folder: continued, not refused
    assert train_from_config(config).state.global_step == 2


def test_a_second_run_started_at_once_is_told_another_process_writes_there(run_config, tmp_path):
    """Issue 36: two runs started at once on one output_dir: the second saw the first run's temporary marker
    and was told the folder "is not empty and was not made by hf-dflash train (it holds
    .training_started.json.<tmp>)". The test holds the lock and leaves the marker's temporary file as the first
    run does at that moment."""
    from hf_dflash.folder_lock import FolderLockedError, folder_lock
    from hf_dflash.trainer.train import output_dir_problem

    config = load_train_config(run_config)
    out = Path(config["training"]["output_dir"])
    with folder_lock(out, "training.output_dir"):
        (out / ".training_started.json.k3j9x2.tmp").write_text("{")
        with pytest.raises(FolderLockedError, match=rf"another process is writing to {out} .*training\.output_dir"):
            train_from_config(config)
        assert output_dir_problem(out) is None  # the other processes of the first run look in too: theirs
    (out / ".training_started.json.k3j9x2.tmp").unlink()


def test_a_corrupt_checkpoint_is_skipped_or_named_never_a_traceback(run_config, capsys):
    """Issue 25: a truncated model.safetensors and a pickle torch.load refuses in rng_state.pth reached users as
    SafetensorError / UnpicklingError tracebacks."""
    import pickle

    config = load_train_config(run_config)
    config["training"]["eval_strategy"] = "no"
    train_from_config(config)
    output = Path(config["training"]["output_dir"])
    config["training"]["max_steps"] = 6
    weights = output / "checkpoint-4" / "model.safetensors"
    intact = weights.read_bytes()
    weights.write_bytes(intact[:100])  # truncated: skipped like an interrupted save
    capsys.readouterr()
    assert train_from_config(config).state.global_step == 6
    out = capsys.readouterr().out
    assert "checkpoint-4 (unreadable model.safetensors" in out and "resuming from checkpoint-2" in out

    config["training"]["max_steps"] = 8
    (output / "checkpoint-6" / "rng_state.pth").write_bytes(pickle.dumps(Path("x")))  # a global torch refuses
    with pytest.raises(ValueError, match=r"Cannot resume from .*checkpoint-6: .*UnpicklingError.*Delete"):
        train_from_config(config)


@pytest.mark.parametrize(
    "section, values, problem",
    [
        ("training", {"max_steps": 0}, "training.max_steps: must be >= 1 (or -1), got 0"),
        ("data", {"eval_samples": -3}, "data.eval_samples: must be >= 0, got -3"),
        ("drafter", {"target_layer_ids": [5, 5]}, "drafter.target_layer_ids: expected distinct 0-based layer ids"),
        ("drafter", {"target_layer_ids": [1.5, 2]}, "drafter.target_layer_ids: expected list[int] or null"),
        ("drafter", {"mask_token_id": True}, "drafter.mask_token_id: expected int or null, got bool True"),
        ("drafter", {"draft_vocab_size": True}, "drafter.draft_vocab_size: expected int or null, got bool True"),
        ("data", {"eval_part": ""}, "data.eval_part: an empty name"),
    ],
)
def test_config_values_out_of_range_are_named_not_coerced(run_config, section, values, problem):
    """Issue 25: max_steps 0 trained one step, eval_samples -3 silently disabled held-out evaluation,
    duplicate layer ids and `true` ids were accepted."""
    from hf_dflash.trainer.config_schema import validate_train_config

    config = load_train_config(run_config)
    config[section] = {**(config.get(section) or {}), **values}
    with pytest.raises(ValueError) as caught:
        validate_train_config(config)
    assert problem in str(caught.value), str(caught.value)


def test_duplicate_layer_ids_on_the_command_line_are_refused(capsys):
    from hf_dflash.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["cache-features", "--data", "d", "--out", "o", "--target-layer-ids", "5,5"])
    assert stop.value.code == 2 and "distinct 0-based layer ids" in capsys.readouterr().err


@pytest.mark.parametrize(
    "path", sorted(Path(__file__).resolve().parents[1].glob("configs/*.yaml")), ids=lambda p: p.name
)
def test_committed_configs_pass_the_strict_reader(path):
    config = load_train_config(path)
    assert config["training"]["output_dir"].startswith("out/")  # never a shipped folder
