"""`hf-dflash recipe`: a tiny local Qwen3 folder to an exported drafter, every stage skipped on a re-run,
interrupted and half-written stages resumed or redone, changed settings refused, derived defaults, bad input."""

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import yaml
from transformers import LlamaConfig

from hf_dflash.cli import main
from hf_dflash.data import corpus, regenerate
from hf_dflash.recipe import derive_defaults
from hf_dflash.trainer.trainer import DFlashTrainer
from tests.conftest import make_target
from tests.helpers.data import EVAL_SUITE, make_char_tokenizer, write_lines
from tests.helpers.training import TWO_CPU_PROCESSES, accelerate_launcher, run_worker

STAGES = ["prompts", "regenerate", "tokenize", "pack", "train", "heldout", "bench", "export"]  # features: off


def tiny_recipe(root):
    """(argv, config) of a tiny recipe run: a random 6-layer Qwen3 with a character tokenizer, 8 prompts."""
    make_target("qwen3").save_pretrained(root / "target")
    make_char_tokenizer().save_pretrained(root / "target")
    prompts = write_lines(
        root / "prompts.jsonl", [{"prompt": f"Tell me about the number {i}, please."} for i in range(10)]
    )
    config = {
        "dtype": "float32",
        "target_id": "tiny/qwen3",
        "data": {"sources": [], "prompts": str(prompts), "max_new_tokens": 24, "batch_size": 4, "shard_size": 4,
                 "max_length": 256, "eval_samples": 2},
        "training": {"block_size": 4, "max_steps": 4, "per_device_train_batch_size": 2, "num_anchors": 8,
                     "save_steps": 2, "logging_steps": 1, "disable_tqdm": True},
        "bench": {"prompts": str(prompts), "num_prompts": 2, "max_new_tokens": 8},
    }  # fmt: skip
    (root / "recipe.yaml").write_text(yaml.safe_dump(config))
    argv = [
        "recipe",
        "--target",
        str(root / "target"),
        "--out",
        str(root / "out"),
        "--config",
        str(root / "recipe.yaml"),
    ]
    return argv + ["--max-prompts", "8"], config


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished tiny recipe folder: (root, argv, what the first run printed)."""
    root = tmp_path_factory.mktemp("recipe")
    argv, _ = tiny_recipe(root)
    stream = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stream):
        patch.setattr(corpus, "load_eval_suite", lambda: EVAL_SUITE)
        assert main(argv) == 0
    return root, argv, stream.getvalue()


def no_work(patch):
    """Make regeneration and training fail the test if they run."""
    patch.setattr(regenerate, "regenerate_shard", lambda *a, **k: pytest.fail("regeneration ran again"))
    patch.setattr(DFlashTrainer, "train", lambda *a, **k: pytest.fail("training ran again"))


def test_tiny_recipe_reaches_an_exported_drafter_and_a_rerun_skips_every_stage(finished, monkeypatch, capsys):
    root, argv, first = finished
    out = root / "out"
    for stage in STAGES:
        assert (
            f"] {stage:<10} " in first and json.loads((out / "stages" / f"{stage}.json").read_text())["stage"] == stage
        )
    assert "features   off in the config" in first and not (out / "stages" / "features.json").exists()
    assert "target_layer_ids = [1, 2, 3] (derived:" in first and "block_size = 4 (config:" in first
    assert "rough ETA" in first and "| stage | status | ETA | time | result |" in first
    export = out / "export"
    for name in ("config.json", "model.safetensors", "README.md", "benchmark.json", "training_record.json"):
        assert (export / name).is_file(), name
    assert (export / "official" / "config.json").is_file()
    card = (export / "README.md").read_text()
    assert "| `num_hidden_layers` | `1` | derived:" in card and "tiny/qwen3" in card
    record = json.loads((export / "training_record.json").read_text())
    assert record["derived_settings"]["target_layer_ids"]["value"] == [1, 2, 3]
    assert json.loads((out / "heldout" / "heldout_tau.json").read_text())["result"]["samples"] == 2
    # no data.max_prompt_tokens: every prompt that leaves room for the 24-token reply in max_length 256
    assert json.loads((out / "data" / "responses" / "config.json").read_text())["max_prompt_tokens"] == 256 - 24

    monkeypatch.setattr(corpus, "load_eval_suite", lambda: EVAL_SUITE)
    no_work(monkeypatch)
    assert main(argv) == 0
    second = capsys.readouterr().out
    assert second.count("done already") == len(STAGES) and "rough ETA" not in second


def test_a_distilling_recipe_caches_the_targets_top_k_beside_its_features_and_trains_on_them(tmp_path, capsys):
    """features.enabled with training.loss_type ce+kl: the features stage also caches the target's top-32 next
    tokens (teacher_top_k null: 32 when distilling) and training reads them offline."""
    argv, config = tiny_recipe(tmp_path)
    config["features"] = {"enabled": True, "batch_size": 4}
    config["drafter"] = {"target_layer_ids": [1, 3]}
    config["training"].update(loss_type="ce+kl", max_steps=2)
    config["heldout"], config["bench"] = {"enabled": False}, {"enabled": False}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(config))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(corpus, "load_eval_suite", lambda: EVAL_SUITE)
        assert main(argv) == 0, capsys.readouterr().err
    assert "and the target's top-32" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "features" / "index.json").read_text())["teacher_top_k"] == 32
    state = json.loads((tmp_path / "out" / "drafter" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and all(entry["loss"] > 0 for entry in state["log_history"] if "loss" in entry)


def test_interrupted_and_half_written_stages_resume_and_changed_settings_are_refused(finished, monkeypatch, capsys):
    root, argv, _ = finished
    out = root / "out"
    monkeypatch.setattr(corpus, "load_eval_suite", lambda: EVAL_SUITE)
    capsys.readouterr()
    # a regeneration killed in its second shard (no marker, shard 1 missing) and an export killed mid-way
    (out / "stages" / "regenerate.json").unlink()
    shard = out / "data" / "responses" / "responses-00001.jsonl"
    before = shard.read_text()
    shard.unlink()
    (out / "stages" / "export.json").unlink()
    (out / "export" / "model.safetensors").write_bytes(b"half-written")
    calls = []
    original = regenerate.regenerate_shard
    monkeypatch.setattr(regenerate, "regenerate_shard", lambda *a, **k: calls.append(1) or original(*a, **k))
    monkeypatch.setattr(DFlashTrainer, "train", lambda *a, **k: pytest.fail("training ran again"))
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "regenerate replies regenerated by the target (resuming)" in text and shard.read_text() == before
    assert len(calls) == 1 and text.count("done already") == len(STAGES) - 2
    assert "export     Hub repository folder with card, rough ETA" in text
    from safetensors.torch import load_file

    assert load_file(out / "export" / "model.safetensors")  # rewritten whole, not taken as complete

    # a changed setting: refused by name, then re-run explicitly with --redo
    config = yaml.safe_load((root / "recipe.yaml").read_text())
    config["bench"]["num_prompts"] = 1
    (root / "changed.yaml").write_text(yaml.safe_dump(config))
    changed = [*argv[:-4], "--config", str(root / "changed.yaml"), "--max-prompts", "8"]
    assert main(changed) == 2
    captured = capsys.readouterr()
    error = captured.err
    assert "[1/9]" not in captured.out  # refused before the first stage
    assert "stage bench" in error and "num_prompts: 2 -> 1" in error and "--redo bench" in error
    assert main([*changed, "--redo", "bench"]) == 0
    text = capsys.readouterr().out
    assert "deleted the output and markers of bench, export" in text and text.count("done already") == 6
    assert main([*argv, "--redo", "bench"]) == 0  # back to the fixture's settings


def test_derived_defaults_follow_the_target():
    def derived(**fields):
        config = LlamaConfig(num_attention_heads=4, num_key_value_heads=4, **fields)
        return {setting.name: setting for setting in derive_defaults(config, {}, {})}

    smol = derived(num_hidden_layers=30, hidden_size=576, vocab_size=49152)
    assert smol["target_layer_ids"].value == [1, 8, 14, 20, 27] and smol["target_layer_ids"].source == "derived"
    assert (smol["block_size"].value, smol["num_hidden_layers"].value, smol["draft_vocab_size"].value) == (8, 2, 8192)
    gemma = derived(num_hidden_layers=18, hidden_size=640, vocab_size=262144)
    assert gemma["draft_vocab_size"].value == 32768 < 262144 and len(gemma["target_layer_ids"].value) == 5
    large = derived(num_hidden_layers=36, hidden_size=4096, vocab_size=151936)
    assert large["target_layer_ids"].value == [1, 9, 17, 25, 33]
    assert (large["block_size"].value, large["num_hidden_layers"].value) == (16, 5)
    small_vocab = derived(num_hidden_layers=6, hidden_size=32, vocab_size=128)
    assert small_vocab["draft_vocab_size"].value is None and small_vocab["target_layer_ids"].value == [1, 2, 3]
    for setting in smol.values():
        assert setting.reason and setting.name in setting.line()
    chosen = derive_defaults(LlamaConfig(num_hidden_layers=30), {"num_hidden_layers": 4}, {"block_size": 16})
    chosen = {setting.name: setting for setting in chosen}
    assert (chosen["num_hidden_layers"].value, chosen["num_hidden_layers"].source) == (4, "config")
    assert (chosen["block_size"].value, chosen["block_size"].source) == (16, "config")


def test_the_recipe_trains_with_what_won_for_the_shipped_drafters_unless_the_config_says_otherwise(tmp_path):
    """D-PACE position weights and early anchors (anchor_decay_tokens 64) trained every shipped drafter since they
    won their pilots; a user's own recipe run gets them too, and its `training` section still decides."""
    from hf_dflash.recipe.config import merge_config
    from hf_dflash.recipe.runner import train_config_for

    def training(section: dict) -> dict:
        config = merge_config({"training": section}) | {"target": "tiny"}
        derived = derive_defaults(LlamaConfig(num_hidden_layers=6, hidden_size=32, vocab_size=128), {}, {})
        return train_config_for(config, derived, tmp_path)["training"]

    defaults = training({})
    assert (defaults["position_weighting"], defaults["anchor_decay_tokens"]) == ("dpace", 64)
    chosen = training({"position_weighting": "decay", "anchor_decay_tokens": 0})
    assert (chosen["position_weighting"], chosen["anchor_decay_tokens"]) == ("decay", 0)


def test_the_recipe_regenerates_long_prompts_unless_the_config_caps_them():
    """Issue 50: long prompts in the training data (documents, code files) lifted the shipped drafter's tau on unseen
    long prompts, so a user's recipe run keeps every prompt that leaves room for the reply within data.max_length;
    data.max_prompt_tokens caps them (512 was the default before)."""
    from hf_dflash.data.pipeline import prompt_token_limit
    from hf_dflash.recipe.config import merge_config

    def limit(data: dict) -> int:
        merged = merge_config({"data": data})["data"]
        return prompt_token_limit(merged["max_prompt_tokens"], merged["max_length"], merged["max_new_tokens"])

    assert limit({}) == 3072 - 512
    assert limit({"max_prompt_tokens": 512}) == 512
    assert limit({"max_prompt_tokens": 4000}) == 3072 - 512  # never past the room max_length leaves
    assert limit({"max_length": 1024, "max_new_tokens": 256}) == 768


def test_bad_input_is_refused_before_anything_is_written(tmp_path, capsys):
    argv, config = tiny_recipe(tmp_path)
    capsys.readouterr()

    def refused(args, *expected):
        assert main(args) == 2
        error = capsys.readouterr().err
        assert error.startswith("hf-dflash recipe: error: ")
        for text in expected:
            assert text in error, error

    out = tmp_path / "out"
    refused(
        ["recipe", "--target", "no-such-model", "--out", str(out)], "Unknown target 'no-such-model'", "known target"
    )
    refused(["recipe", "--target", str(tmp_path / "target"), "--out", str(out)], "--target-id ORG/NAME")
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump({**config, "trainig": {}, "bench": {"num_prompt": 2}}))
    refused(
        [*argv[:-4], "--config", str(tmp_path / "typo.yaml")],
        "trainig: unknown key (did you mean training?)",
        "bench.num_prompt: unknown key (did you mean num_prompts?)",
    )
    (tmp_path / "drafter.yaml").write_text(yaml.safe_dump({**config, "drafter": {"num_layers": 2}}))
    refused([*argv[:-4], "--config", str(tmp_path / "drafter.yaml")], "drafter.num_layers: unknown key")
    refused([*argv, "--target-id", "not a hub id"], "target_id (--target-id)='not a hub id' is not a Hub repository id")
    (tmp_path / "methods.yaml").write_text(yaml.safe_dump({**config, "bench": {"methods": ["plain", "dflsh"]}}))
    refused([*argv[:-4], "--config", str(tmp_path / "methods.yaml")], "Unknown or no methods")
    assert not out.exists()
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    refused(argv, "holds files the recipe did not make (notes.txt)")
    assert [path.name for path in out.iterdir()] == ["notes.txt"]
    refused([*argv, "--redo", "everything"], "--redo 'everything': not a stage")
    shutil.rmtree(out)


def test_the_recipes_own_half_written_claim_is_not_taken_for_foreign_files(tmp_path):
    """Under `accelerate launch` the other process checks --out while the main one writes recipe.json
    atomically (a hidden temporary sibling, then a rename); a killed run can leave that temporary behind."""
    from hf_dflash.recipe.markers import check_recipe_folder

    out = tmp_path / "out"
    out.mkdir()
    (out / ".recipe.json.x1y2z3.tmp").write_text('{"made_by": "hf-dflash re')
    check_recipe_folder(out)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"did not make \(notes.txt\)"):
        check_recipe_folder(out)


@pytest.mark.slow
def test_the_same_recipe_trains_under_accelerate_launch_on_two_cpu_processes(tmp_path):
    """Two gloo processes: the main one runs every stage, the other joins the training (world size 2)."""
    from pathlib import Path

    argv, _ = tiny_recipe(tmp_path)
    worker = str(Path(__file__).parent / "recipe_worker.py")
    launcher = accelerate_launcher(*TWO_CPU_PROCESSES)
    run_worker([*launcher, worker, *argv], cwd=tmp_path)
    record = json.loads((tmp_path / "out" / "export" / "training_record.json").read_text())
    assert record["hyperparameters"]["world_size"] == 2 and record["global_steps"] == 4


@pytest.mark.parametrize(
    "path", sorted((Path(__file__).resolve().parents[1] / "configs" / "recipe").glob("*.yaml")), ids=lambda p: p.name
)
def test_committed_recipe_configs_are_valid(path):
    from hf_dflash.recipe.config import load_recipe_config

    config = load_recipe_config(path, "gemma3-270m", None)  # the target comes from the command line
    assert config["data"]["max_prompts"]  # the committed recipe configs are short runs


def _without(folder: Path, copy: Path, *names: str) -> str:
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns(*names))
    return str(copy)


def _drafter_folder(root: Path) -> str:
    from tests.conftest import make_drafter

    make_drafter(make_target("qwen3")).save_pretrained(root / "a-drafter")
    return str(root / "a-drafter")


# (recipe config changes {section: {key: value}} or {key: value}, keys removed from training, what the refusal names)
WHOLE_RECIPE_CASES = {
    "negative seed": ({"seed": -1}, (), "seed: must be an integer in [0, 4294967295], got -1"),
    "nan learning rate": ({"training": {"learning_rate": float("nan")}}, (), "training.learning_rate"),
    "negative learning rate": ({"training": {"learning_rate": -1e-3}}, (), "training.learning_rate"),
    "zero epochs": ({"training": {"num_train_epochs": 0}}, ("max_steps",), "training.num_train_epochs"),
    "zero save steps": ({"training": {"save_steps": 0}}, (), "training.save_steps"),
    "zero samples per shard": ({"data": {"samples_per_shard": 0}}, (), "data.samples_per_shard"),
    "negative bench prompts": ({"bench": {"num_prompts": -2}}, (), "bench.num_prompts"),
    "zero bench tokens": ({"bench": {"max_new_tokens": 0}}, (), "bench.max_new_tokens"),
    "missing bench prompts": ({"bench": {"prompts": "MISSING"}}, (), "bench.prompts"),
    "missing data prompts": ({"data": {"prompts": "MISSING"}}, (), "data.prompts"),
    "zero feature batch": ({"features": {"enabled": True, "batch_size": 0}}, (), "features.batch_size"),
    "distilling without a teacher": (
        {"features": {"enabled": True, "teacher_top_k": 0}, "training": {"loss_type": "kl", "feature_mode": "offline"}},
        (),
        "features.teacher_top_k: 0 caches no teacher",
    ),
    "two block sizes": ({"drafter": {"block_size": 8}}, (), "drafter.block_size=8 differs from training.block_size=4"),
    "layer past the target": ({"drafter": {"target_layer_ids": [1, 9]}}, (), "target_layer_ids"),
    "draft vocabulary too large": ({"drafter": {"draft_vocab_size": 10**6}}, (), "draft_vocab_size"),
    "policy past the block": ({"drafter": {"block_size_policy": 8}}, (), "block_size_policy=8"),
    "missing init_from": ({"drafter": {"init_from": "MISSING"}}, (), "drafter.init_from"),
}


@pytest.mark.parametrize("case", list(WHOLE_RECIPE_CASES), ids=str)
def test_the_whole_recipe_is_checked_before_the_first_stage(tmp_path, capsys, case):
    """Issue 53 item 5: every setting, every stage's input files and the target folder are checked before any
    stage runs (some were refused only after regeneration and training), naming the key."""
    changes, removed, expected = WHOLE_RECIPE_CASES[case]
    argv, config = tiny_recipe(tmp_path)
    missing = str(tmp_path / "no-such-file.jsonl")
    for key, value in changes.items():
        if isinstance(value, dict):
            config.setdefault(key, {}).update({k: missing if v == "MISSING" else v for k, v in value.items()})
        else:
            config[key] = value
    for key in removed:
        del config["training"][key]
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(config))
    capsys.readouterr()
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("hf-dflash recipe: error: ") and expected in captured.err, captured.err
    assert "[1/9]" not in captured.out and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "target, expected",
    [
        (_drafter_folder, "is a DFlash drafter"),
        (lambda root: _without(root / "target", root / "no-weights", "*.safetensors"), "no weights"),
        (lambda root: _without(root / "target", root / "no-tokenizer", "tokenizer*"), "no tokenizer"),
        (lambda root: _without(root / "target", root / "no-config", "config.json"), "no config.json"),
    ],
    ids=["drafter", "no weights", "no tokenizer", "no config"],
)
def test_a_target_folder_the_recipe_cannot_use_is_refused_before_the_first_stage(tmp_path, capsys, target, expected):
    argv, _ = tiny_recipe(tmp_path)
    folder = target(tmp_path)
    argv[argv.index("--target") + 1] = folder
    capsys.readouterr()
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert f"--target {folder}" in captured.err and expected in captured.err, captured.err
    assert "[1/9]" not in captured.out and not (tmp_path / "out").exists()


def _interrupted_run(argv: list[str], environment: dict, delay: float) -> tuple[int, str]:
    """(exit status, output) of a recipe run sent SIGINT `delay` seconds into its regeneration."""
    import signal
    import subprocess
    import sys
    import time

    worker = str(Path(__file__).parent / "interrupt_worker.py")
    # An ignored signal stays ignored across exec, and Python then installs no KeyboardInterrupt handler: under
    # `make test` the worker once inherited an ignored SIGINT and ran the recipe to exit 0 (both cases; never seen
    # run alone). It gets SIGINT's default disposition, as a command started from a shell does.
    process = subprocess.Popen(
        [sys.executable, worker, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        lines = []
        for line in process.stdout:  # bounded: the process ends, or starts regenerating
            lines.append(line)
            if "regenerating" in line:
                break
        time.sleep(delay)
        process.send_signal(signal.SIGINT)
        rest, _ = process.communicate(timeout=300)
    finally:
        process.kill()
    return process.returncode, "".join(lines) + rest


@pytest.mark.slow
@pytest.mark.parametrize("swallowed", [False, True], ids=["raised", "swallowed by a library"])
def test_ctrl_c_during_regeneration_always_stops_the_recipe_and_a_rerun_resumes(tmp_path, swallowed):
    """Issue 53 item 10: a Ctrl-C during regeneration once let the recipe finish every stage and exit 0 (the
    KeyboardInterrupt was lost). SIGINT at several points: exit 130 every time (never 0, no later stage), even
    when the generation swallows the KeyboardInterrupt; the re-run resumes the regeneration and finishes."""
    import os
    import subprocess
    import sys

    argv, config = tiny_recipe(tmp_path)
    # 128 new tokens a reply: the 15 shards outlast the 1 s delay on a fast CPU (48 finished first once, 2026-12-07)
    config["data"].update(max_new_tokens=128, shard_size=2, batch_size=2)
    config["bench"]["enabled"], config["heldout"] = False, {"enabled": False}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(config))
    write_lines(tmp_path / "prompts.jsonl", [{"prompt": f"Tell me about the number {i}, please."} for i in range(30)])
    argv = [*argv[:-1], "30"]  # --max-prompts 30: 15 shards
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PYTHONUNBUFFERED": "1",
                   "SWALLOW_INTERRUPTS": "1" if swallowed else "0"}  # fmt: skip
    responses = tmp_path / "out" / "data" / "responses"
    for delay in (0.0, 1.0):
        status, output = _interrupted_run(argv, environment, delay)
        assert status == 130 and "interrupted (Ctrl-C)" in output, output[-2000:]
        assert "[3/9]" not in output and not (tmp_path / "out" / "stages" / "regenerate.json").exists()
    shards, begun = len(list(responses.glob("responses-*.jsonl"))), responses.is_dir()
    rerun = subprocess.run([sys.executable, str(Path(__file__).parent / "interrupt_worker.py"), *argv], env=environment,
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-2000:]
    # "(resuming)" means the stage's folder was begun: a Ctrl-C before the first shard (a loaded machine, 1 s in)
    # leaves it holding only the stage's settings, and the re-run resumes on them (the strict "shards > 0" failed then)
    assert ("(resuming)" in rerun.stdout) == begun and (begun or shards == 0)
    assert len(list(responses.glob("responses-*.jsonl"))) == 15
    assert (tmp_path / "out" / "export" / "config.json").is_file()
