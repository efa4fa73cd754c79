"""A Hub-native drafter folder edited or damaged by hand (issue 53, items 7 and 8), refused by name the same way
through `load_drafter` and through the folder's remote code (`AutoModel.from_pretrained(..., trust_remote_code=True)`):
unknown or misspelt config.json keys (with the known keys and the closest one), DFlash2 tensors of the wrong shape
(the tensor, its shape and the one config.json gives), a truncated model.safetensors (its path)."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel

from hf_dflash.checkpoints import load_drafter
from hf_dflash.checkpoints.hub import save_hub
from tests.conftest import make_drafter, make_target
from tests.test_dflash2_serving import dflash2_drafter


def load_remote(folder: Path):
    return AutoModel.from_pretrained(str(folder), trust_remote_code=True)


LOADERS = {"load_drafter": load_drafter, "remote_code": load_remote}


@pytest.fixture(scope="module")
def hub_folder(tmp_path_factory) -> Path:
    return save_hub(dflash2_drafter(make_target("llama")), tmp_path_factory.mktemp("hub") / "drafter")


def edited(folder: Path, tmp_path: Path, name: str, config_edit=None, weights_edit=None) -> Path:
    """A copy of `folder` (config.json, weights, remote code) with its config or weights edited."""
    copy = tmp_path / name
    copy.mkdir()
    for file in folder.iterdir():
        if file.is_file():
            (copy / file.name).write_bytes(file.read_bytes())
    if config_edit is not None:
        config = json.loads((copy / "config.json").read_text())
        config_edit(config)
        (copy / "config.json").write_text(json.dumps(config, indent=2))
    if weights_edit is not None:
        weights = load_file(copy / "model.safetensors")
        weights_edit(weights)
        save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    return copy


@pytest.mark.parametrize("loader", sorted(LOADERS))
@pytest.mark.parametrize(
    ("key", "value", "closest"),
    [("block_size_poliy", 3, "block_size_policy"), ("draft_tree", True, None), ("mask_token", 5, "mask_token_id")],
)
def test_unknown_config_keys_are_refused_with_the_closest_known_key(hub_folder, tmp_path, loader, key, value, closest):
    folder = edited(hub_folder, tmp_path, f"{key}_{loader}", config_edit=lambda c: c.update({key: value}))
    with pytest.raises(ValueError, match=rf"config\.json: unknown key '{key}'") as refusal:
        LOADERS[loader](folder)
    message = str(refusal.value)
    assert (f"did you mean '{closest}'" in message) if closest else ("did you mean" not in message)
    assert "block_size_policy" in message and "target_layer_ids" in message  # the known keys are listed


def test_transformers_standard_keys_and_the_official_layouts_keys_still_load(tmp_path):
    """Keys Transformers itself writes or reads (older versions' too) and the decoder keys of the official layout
    (a Qwen3 config) are no DFlash typo: they load as before."""
    target = make_target("llama")
    extra = {
        "torch_dtype": "float32",
        "use_cache": True,
        "_name_or_path": "somewhere",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "rope_theta": 10000.0,
        "use_sliding_window": False,
        "max_window_layers": 2,
        "output_attentions": False,
    }
    folder = edited(save_hub(make_drafter(target), tmp_path / "drafter"), tmp_path, "extra", lambda c: c.update(extra))
    for loader in LOADERS.values():
        assert loader(folder).config.block_size == 4
    assert AutoConfig.from_pretrained(str(folder), trust_remote_code=True).model_type == "dflash"


def _wrong_projection(weights: dict) -> None:
    weights["layers.0.attention_conv.kernel_projection.weight"] = torch.zeros(3, 32)


def _wrong_codebook(weights: dict) -> None:
    weights["candidate_selector.successor_codebook"] = torch.zeros(100, 6)


@pytest.mark.parametrize("loader", sorted(LOADERS))
@pytest.mark.parametrize(
    ("edit", "pattern"),
    [
        (
            _wrong_projection,
            r"layers\.0\.attention_conv\.kernel_projection\.weight is \(3, 32\) in .* gives \(16, 32\)",
        ),
        (_wrong_codebook, r"candidate_selector\.successor_codebook is \(100, 6\) in .* gives \(128, 6\)"),
    ],
    ids=["kernel_projection", "codebook"],
)
def test_misshaped_dflash2_tensors_are_named_with_the_expected_shape(hub_folder, tmp_path, loader, edit, pattern):
    folder = edited(hub_folder, tmp_path, f"{edit.__name__}_{loader}", weights_edit=edit)
    with pytest.raises(ValueError, match=pattern):
        LOADERS[loader](folder)


@pytest.mark.parametrize("loader", sorted(LOADERS))
@pytest.mark.parametrize("keep", [0.5, 0.001], ids=["data_cut", "header_cut"])
def test_a_truncated_weights_file_is_named(hub_folder, tmp_path, loader, keep):
    folder = edited(hub_folder, tmp_path, f"truncated_{loader}")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: max(int(len(data) * keep), 12)])
    with pytest.raises(ValueError, match=rf"{re.escape(str(weights))}.* truncated or corrupt weights file"):
        LOADERS[loader](folder)


@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_a_weights_file_safetensors_cannot_read_is_named(hub_folder, tmp_path, loader):
    """A complete file whose header safetensors refuses (an unknown dtype): the remote code names the checkpoint
    from safetensors' own error."""
    folder = edited(hub_folder, tmp_path, f"bad_dtype_{loader}")
    header = json.dumps({"fc.weight": {"dtype": "XX", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    with pytest.raises(ValueError, match=rf"{re.escape(str(folder))}.*truncated or corrupt weights file"):
        LOADERS[loader](folder)
