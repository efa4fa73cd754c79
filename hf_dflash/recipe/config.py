"""The recipe config (YAML, every key optional): defaults, validation, and the command-line overrides.

```yaml
target: smollm2-135m-instruct   # or a local Transformers causal-LM folder (--target wins)
target_id: null                 # the target's Hub id for the card (known targets: their own; folders: required)
dtype: auto                     # the target's dtype for regeneration, features, held-out tau and bench
seed: 0
data: {sources: [...], prompts: null, max_prompts: null, max_new_tokens: 512, temperature: 0.0,
       batch_size: 64, shard_size: 256, max_length: 3072, max_prompt_tokens: null,  # null: all that fit
       samples_per_shard: 2048, eval_samples: 32}
features: {enabled: false, dtype: bfloat16, batch_size: 4,   # offline features (training.feature_mode)
           teacher_top_k: null}  # the target's top-K per position; null: 32 when training.loss_type distils
drafter: {}                     # `hf-dflash train`'s drafter section; missing choices are derived
training: {}                    # DFlashTrainingArguments fields (output_dir is the recipe's)
heldout: {enabled: true}        # served-walk tau on data.eval_samples held-out chats
bench: {enabled: true, sets: null, prompts: null, num_prompts: 8, max_new_tokens: 256, methods: [plain, dflash]}
export: {official: true, license: apache-2.0, dtype: null, repo_id: null}
```
"""

from __future__ import annotations

import copy
import difflib
from pathlib import Path

from ..data.regenerate import DEFAULT_REGENERATION_BATCH, DEFAULT_REGENERATION_SHARD
from ..data.sources import DEFAULT_TRAIN_SOURCES
from ..targets import KNOWN_TARGETS, check_target_folder
from .checks import check_recipe_settings

__all__ = ["DEFAULTS", "TRAINING_DEFAULTS", "load_recipe_config", "merge_config"]

DEFAULTS: dict = {
    "target": None,
    "target_id": None,
    "dtype": "auto",
    "seed": 0,
    "data": {
        "sources": list(DEFAULT_TRAIN_SOURCES),
        "prompts": None,
        "max_prompts": None,
        "max_new_tokens": 512,
        "temperature": 0.0,
        "batch_size": DEFAULT_REGENERATION_BATCH,
        "shard_size": DEFAULT_REGENERATION_SHARD,
        "max_length": 3072,
        "max_prompt_tokens": None,  # every prompt that leaves max_new_tokens of room in max_length
        "samples_per_shard": 2048,
        "eval_samples": 32,
    },
    "features": {"enabled": False, "dtype": "bfloat16", "batch_size": 4, "teacher_top_k": None},
    "drafter": {},
    "training": {},
    "heldout": {"enabled": True},
    "bench": {
        "enabled": True,
        "sets": None,
        "prompts": None,
        "num_prompts": 8,
        "max_new_tokens": 256,
        "methods": ["plain", "dflash"],
    },
    "export": {"official": True, "license": "apache-2.0", "dtype": None, "repo_id": None},
}
# DFlashTrainingArguments the recipe sets unless `training` does: the paper's recipe, checkpoints to resume from, and
# what won this repository's pilots at equal compute (docs/drafter-history.md) and trained every drafter shipped
# since: D-PACE position weights (+0.06 held-out tau, the v5 pilot) and early anchors (anchor_decay_tokens 64: +1.3%
# on replies cut at 128 tokens, v6's third cycle)
TRAINING_DEFAULTS = {
    "num_train_epochs": 6,
    "learning_rate": 6e-4,
    "warmup_steps": 0.04,
    "num_anchors": 64,
    "position_weighting": "dpace",
    "anchor_decay_tokens": 64,
    "per_device_train_batch_size": 4,
    "logging_steps": 50,
    "save_strategy": "steps",
    "save_steps": 500,
    "save_total_limit": 2,
    "report_to": "none",
}
FREE_SECTIONS = ("drafter", "training")  # checked by `hf-dflash train`'s schema (config_schema)
DTYPES = ("auto", "float32", "bfloat16", "float16")


def _unknown(key: str, allowed, where: str) -> str:
    close = difflib.get_close_matches(str(key), list(allowed), n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"{where}{key}: unknown key{hint}; allowed: {', '.join(allowed)}"


def _check_value(where: str, value, default, problems: list[str]) -> None:
    if default is None or value is None:
        return
    kinds = (int, float) if isinstance(default, float) else type(default)
    if isinstance(value, bool) != isinstance(default, bool) or not isinstance(value, kinds):
        problems.append(f"{where}: expected {type(default).__name__}, got {value!r}")


def merge_config(config: dict, source: str = "recipe config") -> dict:
    """DEFAULTS overlaid with `config`; ValueError listing every unknown key and wrongly typed value."""
    if not isinstance(config, dict):
        raise ValueError(f"{source} must be a mapping with keys {', '.join(DEFAULTS)}, got {type(config).__name__}.")
    merged, problems = copy.deepcopy(DEFAULTS), []
    for key, value in config.items():
        if key not in DEFAULTS:
            problems.append(_unknown(key, DEFAULTS, ""))
        elif isinstance(DEFAULTS[key], dict):
            if not isinstance(value, dict):
                problems.append(f"{key}: expected a mapping, got {value!r}")
                continue
            for inner, item in value.items():
                if key not in FREE_SECTIONS and inner not in DEFAULTS[key]:
                    problems.append(_unknown(inner, DEFAULTS[key], f"{key}."))
                elif key not in FREE_SECTIONS:
                    _check_value(f"{key}.{inner}", item, DEFAULTS[key][inner], problems)
            merged[key].update(value)
        else:
            _check_value(key, value, DEFAULTS[key], problems)
            merged[key] = value
    if merged["dtype"] not in DTYPES:
        problems.append(f"dtype: expected one of {', '.join(DTYPES)}, got {merged['dtype']!r}")
    if "output_dir" in merged["training"]:
        problems.append("training.output_dir: set by the recipe (OUT/drafter); remove it")
    if problems:
        raise ValueError(f"{source}: " + "; ".join(problems) + ". See docs/recipe.md for the keys.")
    return merged


def load_recipe_config(path: str | Path | None, target: str | None, max_prompts: int | None, target_id=None) -> dict:
    """The recipe config: the YAML file (a repeated key is an error), merged over DEFAULTS, then the
    command line (`--target`, `--max-prompts`, `--target-id`) over it. ValueError names every problem."""
    from ..trainer.train import read_yaml

    config = merge_config((read_yaml(path) or {}) if path is not None else {}, str(path or "recipe config"))
    if target is not None:
        config["target"] = target
    if max_prompts is not None:
        config["data"]["max_prompts"] = max_prompts
    if target_id is not None:
        config["target_id"] = target_id
    name = config["target"]
    if not name:
        raise ValueError("No target: pass --target (a known name or a local Transformers folder) or set target:.")
    if name not in KNOWN_TARGETS and not Path(name).is_dir():
        raise ValueError(
            f"Unknown target {name!r}: neither a known target ({', '.join(KNOWN_TARGETS)}) nor a local model folder."
        )
    if config["target_id"] is None:
        if name not in KNOWN_TARGETS:
            raise ValueError(
                f"--target {name} is a local folder: give its Hub id for the card's base_model with --target-id "
                "ORG/NAME (or target_id: in the config)."
            )
        config["target_id"] = KNOWN_TARGETS[name].hub_id
    check_late_settings(config)
    check_recipe_settings(config)
    if name not in KNOWN_TARGETS:
        check_target_folder(name)
    return config


def check_late_settings(config: dict) -> None:
    """The settings only the last stages read, checked now rather than after training."""
    from ..bench.methods import check_methods
    from ..checkpoints.files import as_dtype
    from ..checkpoints.publish import check_hub_id

    check_hub_id(config["target_id"], "target_id (--target-id)")
    export = config["export"]
    if export["repo_id"] is not None:
        check_hub_id(export["repo_id"], "export.repo_id")
    as_dtype(export["dtype"])
    if config["features"]["dtype"] not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"features.dtype must be bfloat16, float16 or float32, got {config['features']['dtype']!r}.")
    check_methods(config["bench"]["methods"])
    sets = config["bench"]["sets"]
    if sets is not None and (not isinstance(sets, list) or not all(isinstance(name, str) for name in sets)):
        raise ValueError(f"bench.sets must be a list of set names (or null), got {sets!r}.")
