"""Oracle: save -> load round trips in both checkpoint formats, remote-code loading
without our package, the convert CLI, and every loader error naming the offending value."""

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from hf_dflash.checkpoints import (
    HUB_AUTO_MAP,
    OFFICIAL_AUTO_MAP,
    convert,
    load_drafter,
    load_official,
    save_hub,
    save_official,
)
from hf_dflash.cli import main
from hf_dflash.modeling_dflash import DFlashConfig, DFlashDraftModel

TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=128,
    max_position_embeddings=256,
    target_layer_ids=[1, 3],
    num_target_layers=6,
    mask_token_id=127,
    block_size=4,
)
EXPECTED_KEYS = sorted(
    [
        f"layers.{i}.{name}.weight"
        for i in range(2)
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "self_attn.q_norm",
            "self_attn.k_norm",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "input_layernorm",
            "post_attention_layernorm",
        )
    ]
    + ["norm.weight", "fc.weight", "hidden_norm.weight"]
)


def make_model(seed: int = 0) -> DFlashDraftModel:
    torch.manual_seed(seed)
    model = DFlashDraftModel(DFlashConfig(**TINY))
    with torch.no_grad():  # perturb every weight (norms start at 1) so a swapped key changes outputs
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return model.eval()


def make_inputs(seed: int = 1) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        "noise_embeds": torch.randn(1, TINY["block_size"], 32, generator=generator),
        "context_hidden_states": torch.randn(1, 5, 2 * 32, generator=generator),
    }


def run(model: DFlashDraftModel, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(**inputs).last_hidden_state


def assert_same_model(loaded: DFlashDraftModel, reference_output: torch.Tensor, inputs: dict) -> None:
    assert isinstance(loaded, DFlashDraftModel)
    assert not loaded.training
    assert loaded.dtype == torch.float32
    assert torch.equal(run(loaded, inputs), reference_output)


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def inputs():
    return make_inputs()


@pytest.fixture(scope="module")
def expected(model, inputs):
    return run(model, inputs)


@pytest.fixture(scope="module")
def hub_dir(model, tmp_path_factory):
    return save_hub(model, tmp_path_factory.mktemp("hub") / "drafter")


@pytest.fixture(scope="module")
def official_dir(model, tmp_path_factory):
    return save_official(model, tmp_path_factory.mktemp("official") / "drafter")


def copy_of(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "copy"))


def edit_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))


def edit_weights(folder: Path, edit) -> None:
    state_dict = load_file(str(folder / "model.safetensors"))
    state_dict = edit(state_dict)
    save_file(state_dict, str(folder / "model.safetensors"), metadata={"format": "pt"})


# ---------------------------------------------------------------- round trips


def test_hub_format_files_config_and_round_trip(model, hub_dir, inputs, expected):
    names = {p.name for p in hub_dir.iterdir()}
    assert {"config.json", "configuration_dflash.py", "modeling_dflash.py", "model.safetensors", "README.md"} <= names
    config = json.loads((hub_dir / "config.json").read_text())
    assert config["model_type"] == "dflash"
    assert (
        config["auto_map"]
        == HUB_AUTO_MAP
        == {
            "AutoConfig": "configuration_dflash.DFlashConfig",
            "AutoModel": "modeling_dflash.DFlashDraftModel",
        }
    )
    for field in ("block_size", "target_layer_ids", "mask_token_id", "num_target_layers", "vocab_size"):
        assert config[field] == TINY[field], field
    assert config["target_hidden_size"] == 32 and config["hidden_size"] == 32
    for name in ("configuration_dflash.py", "modeling_dflash.py"):
        for node in ast.walk(ast.parse((hub_dir / name).read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = ["." * node.level + (node.module or "")]
            else:
                continue
            for module in modules:  # remote code: torch/transformers/stdlib and its sibling file only
                assert not module.startswith("hf_dflash"), f"{name} imports {module}"
                assert not module.startswith(".") or module == ".configuration_dflash", f"{name} imports {module}"
    assert sorted(load_file(str(hub_dir / "model.safetensors"))) == EXPECTED_KEYS

    assert_same_model(load_drafter(hub_dir), expected, inputs)
    assert_same_model(DFlashDraftModel.from_pretrained(hub_dir), expected, inputs)


def test_official_format_config_and_round_trip(official_dir, hub_dir, inputs, expected):
    config = json.loads((official_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["block_size"] == 4
    assert config["dflash_config"] == {"mask_token_id": 127, "target_layer_ids": [1, 3], "block_size": 4}
    assert config["num_target_layers"] == 6 and config["vocab_size"] == 128
    for field in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "rms_norm_eps",
        "max_position_embeddings",
    ):
        assert field in config, field
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]
    assert config["rope_scaling"] is None  # plain RoPE, as older engines expect
    # z-lab's convention: only AutoModel is remote, so AutoConfig (and every engine) still sees a Qwen3Config.
    assert config["auto_map"] == OFFICIAL_AUTO_MAP == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert {p.name for p in official_dir.iterdir()} == {
        "config.json",
        "model.safetensors",
        "configuration_dflash.py",
        "modeling_dflash.py",
    }
    official_weights = load_file(str(official_dir / "model.safetensors"))
    hub_weights = load_file(str(hub_dir / "model.safetensors"))
    assert sorted(official_weights) == EXPECTED_KEYS
    assert all(torch.equal(official_weights[k], hub_weights[k]) for k in EXPECTED_KEYS)

    assert_same_model(load_official(official_dir), expected, inputs)
    assert_same_model(load_drafter(official_dir), expected, inputs)


def test_official_sharded_and_legacy_rope_and_bf16(model, official_dir, inputs, expected, tmp_path):
    sharded = copy_of(official_dir, tmp_path)
    state_dict = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    keys = sorted(state_dict)
    shards = {"model-00001-of-00002.safetensors": keys[:10], "model-00002-of-00002.safetensors": keys[10:]}
    for name, shard_keys in shards.items():
        save_file({k: state_dict[k] for k in shard_keys}, str(sharded / name), metadata={"format": "pt"})
    weight_map = {k: name for name, shard_keys in shards.items() for k in shard_keys}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    # An older config: rope only as rope_theta/rope_scaling, block_size only top-level, no target_hidden_size.
    def make_legacy(config):
        del config["rope_parameters"], config["target_hidden_size"], config["dflash_config"]["block_size"]

    edit_config(sharded, make_legacy)
    assert_same_model(load_drafter(sharded), expected, inputs)

    bf16 = save_official(model, tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    assert model.dtype == torch.float32  # the given model is not cast
    loaded = load_official(bf16)
    assert loaded.dtype == torch.bfloat16
    reference = DFlashDraftModel.from_pretrained(save_hub(model, tmp_path / "hub_bf16", dtype="bfloat16"))
    assert reference.dtype == torch.bfloat16
    assert torch.equal(run(loaded, inputs), run(reference, inputs))


def test_official_keeps_rope_scaling_and_sliding_layers(inputs, tmp_path):
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    torch.manual_seed(0)
    config = DFlashConfig(
        **TINY, rope_parameters=dict(rope), layer_types=["sliding_attention", "full_attention"], sliding_window=3
    )
    model = DFlashDraftModel(config).eval()
    folder = save_official(model, tmp_path / "yarn")
    written = json.loads((folder / "config.json").read_text())
    assert written["rope_theta"] == 10000.0
    assert written["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}
    assert written["layer_types"] == ["sliding_attention", "full_attention"] and written["sliding_window"] == 3
    qwen3 = AutoConfig.from_pretrained(folder)  # what engines see through Transformers' Qwen3Config
    assert qwen3.model_type == "qwen3" and qwen3.rope_parameters["factor"] == 4.0
    loaded = load_official(folder)
    assert loaded.config.rope_parameters == rope
    assert torch.equal(run(loaded, inputs), run(model, inputs))


REMOTE_SCRIPT = """
import sys
sys.modules["hf_dflash"] = None  # our package must be unreachable
try:
    import hf_dflash
except ImportError:
    pass
else:
    raise SystemExit("hf_dflash is importable")
import torch
from transformers import AutoConfig, AutoModel

folder, config_type = sys.argv[1], sys.argv[2]
config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
model = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
assert not type(model).__module__.startswith("hf_dflash"), type(model).__module__
assert not type(config).__module__.startswith("hf_dflash"), type(config).__module__
assert config.model_type == config_type, config.model_type  # the official layout stays a Qwen3Config for engines
assert type(model).__name__ == "DFlashDraftModel", type(model)
assert model.config.model_type == "dflash" and model.config.mask_token_id == 127, model.config
assert model.config.target_layer_ids == [1, 3] and model.config.block_size == 4, model.config
assert not any(name == "hf_dflash" or name.startswith("hf_dflash.") for name, m in sys.modules.items() if m)
data = torch.load("expected.pt")
with torch.no_grad():
    out = model(**data["inputs"]).last_hidden_state
assert torch.equal(out, data["expected"]), (out - data["expected"]).abs().max()
print("REMOTE_OK", type(model).__module__)
"""


@pytest.fixture(scope="module")
def subprocess_runs(hub_dir, official_dir, inputs, expected, tmp_path_factory):
    """Start both slow subprocesses (Python + torch + transformers start-up) at once, in parallel."""
    remote_cwd = tmp_path_factory.mktemp("remote")
    torch.save({"inputs": inputs, "expected": expected}, remote_cwd / "expected.pt")
    remote_env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(remote_cwd / "modules")}
    remote_env.pop("PYTHONPATH", None)
    script = Path(sys.executable).with_name("hf-dflash")
    cli_out = tmp_path_factory.mktemp("console") / "hub"
    processes = {
        name: subprocess.Popen(
            [sys.executable, "-c", REMOTE_SCRIPT, str(folder), config_type],
            cwd=remote_cwd,
            env={**remote_env, "HF_MODULES_CACHE": str(remote_cwd / f"modules_{name}")},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, folder, config_type in (("remote", hub_dir, "dflash"), ("remote_official", official_dir, "qwen3"))
    }
    if script.is_file():
        processes["console"] = subprocess.Popen(
            [str(script), "convert", str(official_dir), str(cli_out), "--to", "hub"],
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    results = {}
    for name, process in processes.items():
        try:
            stdout, stderr = process.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        results[name] = (process.returncode, stdout, stderr)
    results["console_out"] = cli_out
    results["console_script"] = script
    return results


@pytest.mark.parametrize("layout", ["remote", "remote_official"])
def test_remote_code_loads_without_our_package(subprocess_runs, layout):
    """Both layouts: `AutoModel.from_pretrained(folder, trust_remote_code=True)` is our drafter, same outputs
    (before #13 the official folder silently gave a plain Qwen3Model with fc/hidden_norm dropped)."""
    returncode, stdout, stderr = subprocess_runs[layout]
    assert returncode == 0, stdout + stderr
    assert "REMOTE_OK transformers_modules" in stdout


# ---------------------------------------------------------------- convert / CLI


def test_convert_cli_both_directions(hub_dir, inputs, expected, tmp_path, capsys):
    official = tmp_path / "official"
    assert main(["convert", str(hub_dir), str(official), "--to", "official"]) == 0
    assert json.loads((official / "config.json").read_text())["model_type"] == "qwen3"
    assert_same_model(load_official(official), expected, inputs)

    hub = tmp_path / "hub"
    assert main(["convert", str(official), str(hub), "--to", "hub"]) == 0
    config = json.loads((hub / "config.json").read_text())
    assert config["model_type"] == "dflash" and config["auto_map"] == HUB_AUTO_MAP
    assert (hub / "modeling_dflash.py").is_file() and (hub / "configuration_dflash.py").is_file()
    assert_same_model(load_drafter(hub), expected, inputs)
    assert "Wrote hub DFlash checkpoint" in capsys.readouterr().out

    assert convert(hub, tmp_path / "again", to="official") == tmp_path / "again"
    assert_same_model(load_drafter(tmp_path / "again"), expected, inputs)


def test_cli_reports_errors_and_rejects_bad_format(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["convert", str(tmp_path / "empty"), str(tmp_path / "out"), "--to", "hub"]) == 2
    assert "config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["convert", "a", "b", "--to", "gguf"])
    with pytest.raises(ValueError, match="'gguf'"):
        convert(tmp_path / "empty", tmp_path / "out", to="gguf")


def test_console_script_converts(subprocess_runs, inputs, expected):
    assert subprocess_runs["console_script"].is_file(), "console script missing: run `pip install -e . --no-deps`"
    returncode, stdout, stderr = subprocess_runs["console"]
    assert returncode == 0, stdout + stderr
    assert "Wrote hub DFlash checkpoint" in stdout
    assert_same_model(load_drafter(subprocess_runs["console_out"]), expected, inputs)


# ---------------------------------------------------------------- official-format errors


def _drop(key):
    return lambda c: c["dflash_config"].pop(key)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: c.update(block_size=8), r"block_size=8.*dflash_config\.block_size=4"),
        (_drop("mask_token_id"), r"mask_token_id is missing.*silently.*acceptance"),
        (_drop("target_layer_ids"), r"target_layer_ids is missing.*silently.*acceptance"),
        (lambda c: c.pop("dflash_config"), r"mask_token_id is missing"),
        (lambda c: c.update(model_type="llama"), r"'llama'"),
        (lambda c: c.update(num_target_layers=None), r"num_target_layers"),
        (lambda c: c["dflash_config"].update(mask_token_id=500), r"mask_token_id=500"),
    ],
    ids=[
        "block_size_conflict",
        "no_mask",
        "no_layers",
        "no_dflash_config",
        "model_type",
        "no_num_target_layers",
        "mask_out_of_range",
    ],
)
def test_official_config_errors(official_dir, tmp_path, edit, match):
    folder = copy_of(official_dir, tmp_path)
    edit_config(folder, edit)
    with pytest.raises(ValueError, match=match):
        load_official(folder)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda sd: {**sd, "lm_head.weight": torch.zeros(128, 32)}, r"unexpected keys \['lm_head\.weight'\]"),
        (lambda sd: {k: v for k, v in sd.items() if k != "norm.weight"}, r"missing keys \['norm\.weight'\]"),
        (lambda sd: {f"model.{k}": v for k, v in sd.items()}, r"'model\.' prefix.*removeprefix\('model\.'\)"),
        (
            lambda sd: {**sd, "fc.weight": torch.zeros(32, 96)},
            r"fc\.weight is \(32, 96\) in the checkpoint but config\.json gives \(32, 64\) \(hidden_size=32, "
            r"len\(target_layer_ids\)=2 x target_hidden_size=32\)",
        ),
    ],
    ids=["extra_key", "missing_key", "model_prefix", "shape"],
)
def test_official_weight_errors(official_dir, tmp_path, edit, match):
    folder = copy_of(official_dir, tmp_path)
    edit_weights(folder, edit)
    with pytest.raises(ValueError, match=match):
        load_official(folder)


# ---------------------------------------------------------------- detection / Hub-format errors


def test_hub_download_failures_are_told_apart_from_a_missing_repository(monkeypatch):
    """No network or a refused token is not "no such repository": the error says which, and stays an OSError."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(**kwargs):
        raise LocalEntryNotFoundError("offline mode is enabled")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(OSError, match=r"Could not download the Hub repository org/drafter.*offline mode.*HF_TOKEN"):
        load_drafter("org/drafter")


def test_load_drafter_errors(hub_dir, official_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty has no config\.json"):
        load_drafter(tmp_path / "empty")
    with pytest.raises(ValueError, match=r"nope.*neither a local folder nor"):
        load_drafter(tmp_path / "missing" / "nope")

    unknown = Path(shutil.copytree(hub_dir, tmp_path / "unknown"))
    edit_config(unknown, lambda c: c.update(model_type="llama"))
    with pytest.raises(ValueError, match=r"model_type 'llama'"):
        load_drafter(unknown)

    plain_qwen3 = Path(shutil.copytree(official_dir, tmp_path / "plain"))
    edit_config(plain_qwen3, lambda c: c.pop("dflash_config"))
    with pytest.raises(ValueError, match=r"'qwen3' but no dflash_config"):
        load_drafter(plain_qwen3)

    corrupt_json = Path(shutil.copytree(hub_dir, tmp_path / "corrupt_json"))
    (corrupt_json / "config.json").write_text('{"model_type": "dflash",')
    with pytest.raises(ValueError, match=r"corrupt_json/config\.json is not valid JSON"):
        load_drafter(corrupt_json)

    for name, source in (("corrupt_hub", hub_dir), ("corrupt_official", official_dir)):
        corrupt = Path(shutil.copytree(source, tmp_path / name))
        (corrupt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
        with pytest.raises(ValueError, match=rf"{name}/model\.safetensors is not a readable safetensors file"):
            load_drafter(corrupt)

    no_weights = Path(shutil.copytree(hub_dir, tmp_path / "no_weights"))
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"neither model\.safetensors nor model\.safetensors\.index\.json"):
        load_drafter(no_weights)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda sd: {**sd, "lm_head.weight": torch.zeros(128, 32)}, r"lm_head\.weight"),
        (lambda sd: {k: v for k, v in sd.items() if k != "hidden_norm.weight"}, r"hidden_norm\.weight"),
    ],
    ids=["extra_key", "missing_key"],
)
def test_hub_from_pretrained_rejects_key_mismatch(hub_dir, tmp_path, edit, match):
    folder = copy_of(hub_dir, tmp_path)
    edit_weights(folder, edit)
    with pytest.raises(ValueError, match=match):
        DFlashDraftModel.from_pretrained(folder)
    with pytest.raises(ValueError, match=match):
        load_drafter(folder)


def test_weights_of_another_size_are_named_with_the_config_value(hub_dir, official_dir, tmp_path):
    """Issue 36: a Hub-format config.json whose intermediate_size does not match the weights got Transformers'
    load report and a RuntimeError; now our ValueError names the file, the tensor, both shapes and the field."""
    for name, source in (("hub", hub_dir), ("official", official_dir)):
        folder = Path(shutil.copytree(source, tmp_path / name))
        edit_config(folder, lambda c: c.update(intermediate_size=96))
        with pytest.raises(ValueError) as caught:
            load_drafter(folder)
        message = str(caught.value)
        assert "layers.0.mlp.down_proj.weight is (32, 64) in" in message, message
        assert "config.json gives (32, 96) (hidden_size=32, intermediate_size=96)" in message, message
        assert "and 3 more" in message and "set config.json to the sizes the weights were trained with" in message


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("block_size", 10**12, r"block_size=1000000000000 is larger than max_position_embeddings=256"),
        ("block_size", 300, r"block_size=300 is larger than max_position_embeddings=256"),
        ("num_attention_heads", 0, r"num_attention_heads=0 must be an integer >= 1"),
        ("num_key_value_heads", 0, r"num_key_value_heads=0 must be an integer >= 1"),
        ("rms_norm_eps", float("nan"), r"rms_norm_eps=nan must be a finite number"),
        ("hidden_act", "swishy", r"hidden_act='swishy' is not an activation Transformers knows"),
    ],
)
def test_out_of_range_config_values_are_refused_when_read(hub_dir, official_dir, tmp_path, field, value, match):
    """Issue 36: each loaded (a block of 10**12 then allocated terabytes) or crashed inside Transformers."""
    for name, source in (("hub", hub_dir), ("official", official_dir)):
        folder = Path(shutil.copytree(source, tmp_path / name))
        edit_config(folder, lambda c: c.update({field: value}))
        if name == "official" and field == "block_size":
            edit_config(folder, lambda c: c["dflash_config"].update(block_size=value))
        with pytest.raises(ValueError, match=match):
            load_drafter(folder)


# ---------------------------------------------------------------- Hub-format config errors (issue #13 B1)


@pytest.mark.parametrize("field", ["mask_token_id", "target_layer_ids"])
def test_hub_config_without_the_dflash_ids_is_refused(hub_dir, tmp_path, field):
    """Without them the class defaults (Qwen3-8B's 151669 / [1, 9, 17, 25, 33]) would load silently."""
    folder = copy_of(hub_dir, tmp_path)
    edit_config(folder, lambda c: c.pop(field))
    match = rf"config\.json has no {field}.*acceptance"
    with pytest.raises(ValueError, match=match):
        load_drafter(folder)
    with pytest.raises(ValueError, match=match):
        DFlashDraftModel.from_pretrained(folder)
    with pytest.raises(ValueError, match=match):
        AutoConfig.from_pretrained(folder)
    edit_config(folder, lambda c: c.update({field: None}))
    with pytest.raises(ValueError, match=field):
        load_drafter(folder)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("target_layer_ids", [1.7, 3], r"target_layer_ids item=1.7 must be an integer"),
        ("target_layer_ids", "13", r"target_layer_ids='13' must be a list"),
        ("target_layer_ids", [True, 3], r"target_layer_ids item=True must be an integer"),
        ("mask_token_id", True, r"mask_token_id=True must be an integer"),
        ("draft_vocab_size", True, r"draft_vocab_size=True must be an int"),
        ("block_size", True, r"block_size must be an int >= 2"),
    ],
)
def test_config_values_are_never_coerced(hub_dir, tmp_path, field, value, match):
    """Issue 25: a float layer id was truncated, a string split into characters, `true` read as 1."""
    folder = copy_of(hub_dir, tmp_path)
    edit_config(folder, lambda c: c.update({field: value}))
    with pytest.raises(ValueError, match=match):
        load_drafter(folder)
    with pytest.raises(ValueError, match=match):
        DFlashConfig(**{**TINY, field: value})


def test_missing_rope_settings_are_refused_in_every_format(model, hub_dir, official_dir, speculators_dir, tmp_path):
    """Issue 25: without a RoPE base each format fell back to its own default (1e6 / 1e4), silently."""
    hub = copy_of(hub_dir, tmp_path / "hub")
    edit_config(hub, lambda c: c.pop("rope_parameters"))
    with pytest.raises(ValueError, match=r"config.json has no rope_parameters \(nor rope_theta\)"):
        load_drafter(hub)
    edit_config(hub, lambda c: c.update(rope_theta=12345.0))  # the older key still says it
    assert load_drafter(hub).config.rope_parameters["rope_theta"] == 12345.0

    official = copy_of(official_dir, tmp_path / "official")
    edit_config(official, lambda c: [c.pop(key, None) for key in ("rope_theta", "rope_parameters", "rope_scaling")])
    with pytest.raises(ValueError, match=r"config.json: no rope_theta"):
        load_drafter(official)

    speculators = copy_of(speculators_dir, tmp_path / "speculators")
    theta = model.config.rope_parameters["rope_theta"]

    def to_top_level(config):
        config["transformer_layer_config"].pop("rope_parameters")
        config["rope_theta"] = theta

    edit_config(speculators, to_top_level)  # a top-level rope_theta was ignored (default 1e4 used)
    assert load_drafter(speculators, num_target_layers=6).config.rope_parameters["rope_theta"] == theta
    edit_config(speculators, lambda c: c.pop("rope_theta"))
    with pytest.raises(ValueError, match=r"no rope_theta"):
        load_drafter(speculators, num_target_layers=6)
    edit_config(speculators, lambda c: c.update(rope_theta=1.0) or c["transformer_layer_config"].update(rope_theta=2.0))
    with pytest.raises(
        ValueError, match=r"rope_theta 2.0 in transformer_layer_config disagrees with the top-level 1.0"
    ):
        load_drafter(speculators, num_target_layers=6)


def test_a_speculators_config_without_vocab_size_says_so(speculators_dir, tmp_path):
    folder = copy_of(speculators_dir, tmp_path)
    edit_config(folder, lambda c: c["transformer_layer_config"].pop("vocab_size"))
    with pytest.raises(ValueError, match=r"transformer_layer_config.vocab_size is missing"):
        load_drafter(folder, num_target_layers=6)


def test_draft_vocabulary_buffers_of_the_wrong_length_are_named(tmp_path):
    """Issue 25: a Hub-format folder whose d2t/t2d disagree with its config got Transformers' raw
    size-mismatch error."""
    drafter = DFlashDraftModel(DFlashConfig(**{**TINY, "draft_vocab_size": 16})).eval()
    drafter.set_draft_vocab(list(range(16)))
    folder = save_hub(drafter, tmp_path / "drafter")
    assert load_drafter(folder).config.draft_vocab_size == 16
    edit_config(folder, lambda c: c.update(draft_vocab_size=8))
    with pytest.raises(ValueError, match=r"model.safetensors: d2t has shape \[16\], but .*draft_vocab_size=8"):
        load_drafter(folder)


# ---------------------------------------------------------------- other published layouts (issue #13 A3, A5)


def speculators_folder(model: DFlashDraftModel, folder: Path) -> Path:
    """A vLLM speculators DFlash checkpoint of `model`: `speculators_config` + the decoder nested in
    `transformer_layer_config`, aux_hidden_state_layer_ids indexing the target's hidden_states (ours + 1),
    and the verifier's embedding / LM head copies and vocabulary maps beside the drafter weights."""
    folder.mkdir(parents=True)
    config = model.config
    layer_config = {
        "model_type": "qwen3",
        "vocab_size": 128,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": 256,
        "rope_parameters": dict(config.rope_parameters),
        "attention_bias": False,
    }
    (folder / "config.json").write_text(
        json.dumps(
            {
                "speculators_model_type": "dflash",
                "architectures": ["DFlashSpeculator"],
                "speculators_version": "0.4.0",
                "block_size": 4,
                "draft_vocab_size": 128,
                "mask_token_id": 127,
                "aux_hidden_state_layer_ids": [2, 4],
                "target_hidden_size": 32,
                "sliding_window_non_causal": False,
                "projector_type": "dflash",
                "sample_from_anchor": False,
                "transformer_layer_config": layer_config,
                "speculators_config": {
                    "algorithm": "dflash",
                    "default_proposal_method": "greedy",
                    "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                    "verifier": {"name_or_path": "tiny/qwen3-target", "architectures": ["Qwen3ForCausalLM"]},
                },
            }
        )
    )
    weights = {key: value.clone() for key, value in model.state_dict().items()}
    weights |= {
        "embed_tokens.weight": torch.randn(128, 32),
        "lm_head.weight": torch.randn(128, 32),
        "d2t": torch.zeros(128, dtype=torch.long),
        "t2d": torch.ones(128, dtype=torch.bool),
    }
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def speculators_dir(model, tmp_path_factory):
    return speculators_folder(model, tmp_path_factory.mktemp("speculators") / "drafter")


def test_speculators_checkpoint_loads(speculators_dir, inputs, expected, tmp_path, capsys):
    loaded = load_drafter(speculators_dir, num_target_layers=6)
    assert loaded.config.target_layer_ids == [1, 3] and loaded.config.mask_token_id == 127
    assert loaded.config.block_size == 4 and loaded.config.num_target_layers == 6
    assert_same_model(loaded, expected, inputs)
    assert (
        main(["convert", str(speculators_dir), str(tmp_path / "hub"), "--to", "hub", "--num-target-layers", "6"]) == 0
    )
    assert_same_model(load_drafter(tmp_path / "hub"), expected, inputs)


def test_speculators_checkpoint_needs_the_target_depth(speculators_dir):
    with pytest.raises(ValueError, match=r"verifier \(tiny/qwen3-target\).*pass num_target_layers="):
        load_drafter(speculators_dir)


def _set(**fields):
    return lambda c: c.update(fields)


@pytest.mark.parametrize(
    "edit, match",
    [
        (_set(projector_type="domino"), r"projector_type='domino'"),
        (_set(sample_from_anchor=True), r"sample_from_anchor=True"),
        (_set(shift_label=True), r"shift_label=True"),
        (_set(draft_vocab_size=64), r"draft_vocab_size=64.*128"),
        (_set(speculators_model_type="dflash2"), r"DFlash2"),
        (_set(speculators_model_type="eagle3"), r"'eagle3'.*not a DFlash"),
        (_set(aux_hidden_state_layer_ids=[0, 4]), r"aux_hidden_state_layer_ids \[0, 4\]"),
        (lambda c: c.pop("mask_token_id"), r"mask_token_id"),
        (lambda c: c.pop("aux_hidden_state_layer_ids"), r"aux_hidden_state_layer_ids"),
    ],
    ids=[
        "domino",
        "sample_from_anchor",
        "shift_label",
        "reduced_vocab",
        "dflash2",
        "eagle3",
        "aux_zero",
        "no_mask",
        "no_layers",
    ],
)
def test_speculators_checkpoints_that_cannot_be_served_are_named(speculators_dir, tmp_path, edit, match):
    folder = copy_of(speculators_dir, tmp_path)
    edit_config(folder, edit)
    with pytest.raises(ValueError, match=match):
        load_drafter(folder, num_target_layers=6)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda c: c.update(architectures=["DFlash2DraftModel"]), r"DFlash2 checkpoint .*lacks \['conv_kernel_size'"),
        (
            lambda c: c["dflash_config"].update(conv_kernel_size=2, selector_rank=8),
            r"DFlash2 checkpoint \(dflash_config\.conv_kernel_size\).*lacks \['conv_group_size', 'selector_top_k'\]",
        ),
        (lambda c: c["dflash_config"].update(output_multiplier=0.0), r"output_multiplier=0\.0 must be > 0"),
        (lambda c: c.update(final_logit_softcapping=20.0), r"top-level final_logit_softcapping=20\.0 differs"),
        (lambda c: c.update(is_causal=True), r"is_causal=true"),
    ],
    ids=["dflash2_architecture", "dflash2_fields", "output_multiplier", "softcapping", "causal_everywhere"],
)
def test_official_variants_that_cannot_be_served_are_named(official_dir, tmp_path, edit, match):
    folder = copy_of(official_dir, tmp_path)
    edit_config(folder, edit)
    with pytest.raises(ValueError, match=match):
        load_drafter(folder)


@pytest.mark.parametrize("non_causal", [False, True])
def test_sliding_layer_semantics_survive_both_formats(tmp_path, inputs, non_causal):
    torch.manual_seed(0)
    config = DFlashConfig(
        **TINY,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=3,
        sliding_window_non_causal=non_causal,
    )
    model = DFlashDraftModel(config).eval()
    official = save_official(model, tmp_path / "official")
    written = json.loads((official / "config.json").read_text())
    assert written["dflash_config"]["sliding_window_non_causal"] is non_causal
    assert written.get("is_causal", None) is (False if non_causal else None)  # z-lab's name for the same
    for folder in (official, save_hub(model, tmp_path / "hub")):
        loaded = load_drafter(folder)
        assert loaded.config.sliding_window_non_causal is non_causal
        assert torch.equal(run(loaded, inputs), run(model, inputs))


def test_zlab_is_causal_false_means_bidirectional_sliding_layers(tmp_path):
    torch.manual_seed(0)
    config = DFlashConfig(**TINY, layer_types=["sliding_attention"] * 2, sliding_window=3)
    folder = save_official(DFlashDraftModel(config), tmp_path / "zlab")

    def as_zlab(c):
        del c["dflash_config"]["sliding_window_non_causal"]
        c["is_causal"] = False

    edit_config(folder, as_zlab)
    assert load_drafter(folder).config.sliding_window_non_causal is True
    edit_config(folder, lambda c: c.pop("is_causal"))
    assert load_drafter(folder).config.sliding_window_non_causal is False  # z-lab's default too: causal


# ---------------------------------------------------------------- convert into an existing folder (issue #13 B2)


def test_convert_refuses_a_non_empty_destination(hub_dir, official_dir, tmp_path, capsys):
    other = Path(shutil.copytree(official_dir, tmp_path / "other_drafter"))
    (other / "README.md").write_text("another drafter's card\n")
    before = {p.name: p.read_bytes() for p in other.iterdir()}
    assert main(["convert", str(hub_dir), str(other), "--to", "official"]) == 2
    err = capsys.readouterr().err
    assert "hf-dflash convert: error:" in err and "not empty" in err and "--overwrite" in err
    assert {p.name: p.read_bytes() for p in other.iterdir()} == before  # untouched
    with pytest.raises(ValueError, match="overwrite=True"):
        convert(hub_dir, other, to="official")


def test_convert_overwrite_replaces_the_whole_folder(hub_dir, inputs, expected, tmp_path):
    destination = tmp_path / "dst"
    destination.mkdir()
    (destination / "README.md").write_text("stale card of another drafter\n")
    (destination / "notes.txt").write_text("stale\n")
    assert main(["convert", str(hub_dir), str(destination), "--to", "official", "--overwrite"]) == 0
    assert {p.name for p in destination.iterdir()} == {
        "config.json",
        "model.safetensors",
        "configuration_dflash.py",
        "modeling_dflash.py",
    }
    assert_same_model(load_drafter(destination), expected, inputs)
    assert main(["convert", str(hub_dir), str(tmp_path / "empty_is_fine"), "--to", "hub"]) == 0


def test_convert_overwrite_never_deletes_its_source(hub_dir, tmp_path):
    source = Path(shutil.copytree(hub_dir, tmp_path / "parent" / "src"))
    with pytest.raises(ValueError, match="holds the source"):
        convert(source, tmp_path / "parent", to="official", overwrite=True)
    assert (source / "model.safetensors").is_file()
