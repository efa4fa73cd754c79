"""The `hf-dflash train` YAML, checked before anything is loaded: every unknown key, wrong type and
missing key of every section is collected and reported at once, one line per problem naming the
section, the key and the expected type.

Sections: `target` (str, required), `target_dtype` (auto | float32 | bfloat16 | float16), `drafter`
(`DFlashConfig.from_target_config` arguments and overridable `DFlashConfig` fields, or `init_from`),
`data` (`tokenized` required, `features`, `eval_samples`, `max_train_samples`, `parts`, `eval_part`), `lora` (`peft.LoraConfig` fields, or null)
and `training` (`DFlashTrainingArguments` fields, `output_dir` required).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import re
import types
import typing
from typing import Any

from ..modeling_dflash import DFlashConfig
from ..modeling_dflash.configuration_dflash import DFLASH2_FIELDS
from .arguments import DFlashTrainingArguments

SECTIONS = ("target", "target_dtype", "drafter", "data", "lora", "training")
TARGET_DTYPES = ("auto", "float32", "bfloat16", "float16")
# `from_target_config` arguments, then the DFlashConfig fields a config may override. The target fixes
# the others (vocab_size, hidden_size, num_target_layers, target_hidden_size).
DRAFTER_ARGUMENTS = {
    "init_from": str,
    "init_from_target": bool | list[int],
    "upgrade_to_dflash2": dict,  # with init_from: {conv_kernel_size, conv_group_size, selector_rank, selector_top_k}
    "num_hidden_layers": int,
    "block_size": int,
    "num_target_features": int | None,
    "mask_token_id": int | None,
    "target_layer_ids": list[int] | None,
}
DRAFTER_OVERRIDES = (
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "rope_parameters",
    "attention_bias",
    "attention_dropout",
    "sliding_window",
    "layer_types",
    "sliding_window_non_causal",
    "draft_vocab_size",
    "block_size_policy",
)
DATA_FIELDS = {
    "tokenized": str,
    "features": str | None,
    "eval_samples": int,
    "max_train_samples": int | None,
    "parts": list[str] | None,
    "eval_part": str | None,
}
# PyYAML (YAML 1.1) reads 6e-4 (no dot) as a string; in a float field it is the number the user meant.
_EXPONENT_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")


def _type_name(expected) -> str:
    """'int', 'list[int] or null', 'one of a, b', ... for the error messages."""
    if expected is type(None):
        return "null"
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(_type_name(arg) for arg in args))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(arg) for arg in args)
    if origin in (list, dict, tuple):
        return f"{origin.__name__}[{', '.join(_type_name(arg) for arg in args)}]" if args else origin.__name__
    if isinstance(expected, type) and issubclass(expected, enum.Enum):
        return "one of " + ", ".join(repr(member.value) for member in expected)
    return getattr(expected, "__name__", str(expected))


def _fits(value, expected) -> bool:
    """Whether a YAML value (after `_coerce`) is of the annotated type `expected`."""
    if expected is Any or expected is typing.Any:
        return True
    if expected is type(None) or expected is None:
        return value is None
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in args)
    if origin is typing.Literal:
        return value in args
    if origin in (list, tuple):
        return isinstance(value, list) and (not args or all(_fits(item, args[0]) for item in value))
    if origin is dict:
        return isinstance(value, dict) and (not args or all(_fits(v, args[1]) for v in value.values()))
    if expected is bool:
        return isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(expected, type) and issubclass(expected, enum.Enum):
        return isinstance(value, expected) or value in {member.value for member in expected}
    if isinstance(expected, type):
        return isinstance(value, expected)
    return True  # an annotation this checker does not model: left to the constructor


def _accepts_float(expected) -> bool:
    if expected is float:
        return True
    return typing.get_origin(expected) in (typing.Union, types.UnionType) and float in typing.get_args(expected)


def _coerce(value, expected):
    """YAML-1.1 exponent strings ('6e-4') become floats where a float (and no str) is expected."""
    if (
        isinstance(value, str)
        and _EXPONENT_FLOAT.match(value)
        and _accepts_float(expected)
        and not _fits(value, expected)
    ):
        return float(value)
    return value


def _describe(value) -> str:
    shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
    return f"{type(value).__name__} {shown}"


def _check_mapping(
    section: str,
    values,
    fields: dict,
    problems: list[str],
    required: tuple[str, ...] = (),
    list_allowed: bool = True,
) -> dict:
    """Check one section's keys and value types against `fields` ({key: type}); returns it coerced."""
    if not isinstance(values, dict):
        problems.append(f"{section}: expected a mapping of keys, got {_describe(values)}")
        return {}
    checked = {}
    for key, value in values.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else ""
            allowed = f"; allowed: {', '.join(sorted(fields))}" if list_allowed else ""
            problems.append(f"{section}.{key}: unknown key{hint}{allowed}")
            continue
        value = _coerce(value, fields[key])
        if not _fits(value, fields[key]):
            problems.append(f"{section}.{key}: expected {_type_name(fields[key])}, got {_describe(value)}")
        checked[key] = value
    for key in required:
        if key not in values:
            problems.append(f"{section}.{key}: missing (expected {_type_name(fields[key])})")
    return checked


def _dataclass_fields(cls) -> dict:
    hints = typing.get_type_hints(cls)
    return {field.name: hints.get(field.name, Any) for field in dataclasses.fields(cls) if field.init}


def _drafter_fields() -> dict:
    hints = DFlashConfig.__annotations__  # its own fields only (the base class's name torch lazily)
    return {**DRAFTER_ARGUMENTS, **{name: hints[name] for name in DRAFTER_OVERRIDES}}


def _check_upgrade(drafter: dict, problems: list[str]) -> None:
    """drafter.upgrade_to_dflash2: only with init_from, keys among the DFlash2 sizes, positive integers."""
    upgrade = drafter.get("upgrade_to_dflash2")
    if not isinstance(upgrade, dict):
        return
    if "init_from" not in drafter:
        problems.append("drafter.upgrade_to_dflash2: upgrades the drafter of drafter.init_from; set init_from")
    for key, value in upgrade.items():
        if key not in DFLASH2_FIELDS:
            problems.append(f"drafter.upgrade_to_dflash2.{key}: unknown; allowed: {', '.join(DFLASH2_FIELDS)}")
        elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"drafter.upgrade_to_dflash2.{key}: expected an int >= 1, got {value!r}")


def _lora_fields() -> dict:
    from peft import LoraConfig

    return _dataclass_fields(LoraConfig)


# Values a type check lets through that would run silently wrong: (section, key, lowest value, also allowed).
RANGES = (
    ("data", "eval_samples", 0, None),  # a negative count silently disabled held-out evaluation
    ("data", "max_train_samples", 1, None),
    ("training", "max_steps", 1, -1),  # -1: train num_train_epochs; 0 trained one step
    ("training", "block_size", 2, None),
    ("training", "num_anchors", 1, None),
    ("training", "per_device_train_batch_size", 1, None),
    ("training", "gradient_accumulation_steps", 1, None),
    ("drafter", "num_hidden_layers", 1, None),
    ("drafter", "num_target_features", 1, None),
    ("drafter", "block_size", 2, None),
    ("drafter", "mask_token_id", 0, None),
    ("drafter", "draft_vocab_size", 1, None),
)


# training numbers (int or float) that must be finite and positive (> 0), with what a value below 1 means, or
# non-negative (>= 0: a learning rate of 0 keeps the initial weights); NaN and negative values trained in silence.
POSITIVE_NUMBERS = {
    "save_steps": "below 1: a fraction of the run",
    "logging_steps": "below 1: a fraction of the run",
    "eval_steps": "below 1: a fraction of the run",
}
NON_NEGATIVE_NUMBERS = (
    "learning_rate",
    "weight_decay",
    "warmup_steps",
    "warmup_ratio",
    "max_grad_norm",
    "adam_epsilon",
)
MAX_SEED = 2**32 - 1  # numpy's seed range (Trainer's set_seed seeds numpy)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_training_numbers(training: dict, problems: list[str]) -> None:
    """NaN, infinite, negative or zero values of the training floats; epochs without steps; seeds."""
    for key, why in POSITIVE_NUMBERS.items():
        value = training.get(key)
        if _number(value) and not 0 < value < float("inf"):
            problems.append(f"training.{key}: must be a finite number > 0 ({why}), got {value}")
    for key in NON_NEGATIVE_NUMBERS:
        value = training.get(key)
        if _number(value) and not 0 <= value < float("inf"):
            problems.append(f"training.{key}: must be a finite number >= 0, got {value}")
    epochs, steps = training.get("num_train_epochs"), training.get("max_steps", -1)
    if _number(epochs) and not 0 < epochs < float("inf") and not (_number(steps) and steps >= 1):
        problems.append(
            f"training.num_train_epochs: must be a finite number > 0 without training.max_steps, got {epochs} "
            "(it trained no step and saved the untrained drafter); raise it or set max_steps"
        )
    for key in ("seed", "data_seed"):
        value = training.get(key)
        if _number(value) and not 0 <= value <= MAX_SEED:
            problems.append(f"training.{key}: must be an integer in [0, {MAX_SEED}], got {value}")


def _check_ranges(checked: dict, problems: list[str]) -> None:
    """Numbers of the right type but out of range, and duplicate or negative layer ids."""
    for section, key, lowest, allowed in RANGES:
        value = (checked.get(section) or {}).get(key) if isinstance(checked.get(section), dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value < lowest and value != allowed:
            also = f" (or {allowed})" if allowed is not None else ""
            problems.append(f"{section}.{key}: must be >= {lowest}{also}, got {value}")
    if isinstance(checked.get("training"), dict):
        _check_training_numbers(checked["training"], problems)
    drafter = checked.get("drafter") if isinstance(checked.get("drafter"), dict) else {}
    for key in ("target_layer_ids", "init_from_target"):
        ids = drafter.get(key)
        if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
            if len(set(ids)) != len(ids) or any(i < 0 for i in ids):
                problems.append(f"drafter.{key}: expected distinct 0-based layer ids, got {ids}")
    training = checked.get("training") if isinstance(checked.get("training"), dict) else {}
    blocks = (drafter.get("block_size"), training.get("block_size", DFlashConfig.block_size))
    if all(isinstance(block, int) for block in blocks) and blocks[0] != blocks[1]:
        problems.append(
            f"drafter.block_size={blocks[0]} differs from training.block_size={blocks[1]}: the drafter trains at "
            "training.block_size; set one of them"
        )
    part = (checked.get("data") or {}).get("eval_part") if isinstance(checked.get("data"), dict) else None
    if isinstance(part, str) and not part.strip():
        problems.append("data.eval_part: an empty name; give the part to hold out, or null")


def validate_train_config(config, source: str = "config") -> dict:
    """The training config with YAML exponent floats converted; raises one `ValueError` that lists
    every problem (`section.key: problem (expected type)`), one per line."""
    problems: list[str] = []
    if not isinstance(config, dict):
        raise ValueError(f"{source} must hold a mapping with sections {', '.join(SECTIONS)}.")
    checked = dict(config)
    for key in config:
        if key not in SECTIONS:
            close = difflib.get_close_matches(str(key), SECTIONS, n=1)
            problems.append(f"{key}: unknown section(s) {[key]}{f' (did you mean {close[0]}?)' if close else ''}; "
                            f"allowed: {', '.join(SECTIONS)}")  # fmt: skip
    for section in ("target", "data", "training"):
        if section not in config:
            problems.append(f"{section}: missing section")
    if "target" in config and not isinstance(config["target"], str):
        problems.append(
            f"target: expected str (a known target name or a model folder), got {_describe(config['target'])}"
        )
    dtype = config.get("target_dtype", "float32")
    if not isinstance(dtype, str) or dtype not in TARGET_DTYPES:
        problems.append(f"target_dtype: expected one of {', '.join(TARGET_DTYPES)}, got {_describe(dtype)}")

    if config.get("drafter") is not None:
        drafter = _check_mapping("drafter", config["drafter"], _drafter_fields(), problems)
        if "init_from" in drafter:
            for key in drafter:
                if key not in ("init_from", "block_size", "upgrade_to_dflash2"):
                    problems.append(
                        f"drafter.{key}: ignored with drafter.init_from (the loaded drafter keeps its own); remove it"
                    )
        _check_upgrade(drafter, problems)
        checked["drafter"] = drafter
    if "data" in config:
        checked["data"] = _check_mapping("data", config["data"], DATA_FIELDS, problems, required=("tokenized",))
    if config.get("lora") is not None:
        checked["lora"] = _check_mapping("lora", config["lora"], _lora_fields(), problems)
    if "training" in config:
        training_fields = _dataclass_fields(DFlashTrainingArguments)
        training_fields["output_dir"] = str  # required here: resuming and finished-run detection live there
        training = _check_mapping(
            "training", config["training"], training_fields, problems, required=("output_dir",), list_allowed=False
        )
        checked["training"] = training
        if training.get("feature_mode") == "offline" and isinstance(config.get("data"), dict):
            if not config["data"].get("features"):
                problems.append("data.features: missing (expected str): training.feature_mode is offline")
    _check_ranges(checked, problems)
    if problems:
        listing = "\n".join(f"  - {problem}" for problem in problems)
        raise ValueError(f"{source}: {len(problems)} problem(s) in the training config:\n{listing}")
    return checked


__all__ = ["SECTIONS", "validate_train_config"]
