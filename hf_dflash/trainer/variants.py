"""Training variants: a drafter recipe named as overrides of a base training config.

    parse_variant("L2-kl:num_hidden_layers=2,training.loss_type=kl")
    -> ("L2-kl", {"drafter": {"num_hidden_layers": 2}, "training": {"loss_type": "kl"}, "data": {}})

A spec is `NAME:key=value,...`: a bare key is a drafter (`DFlashConfig`) field, `training.` / `data.`
keys reach those sections of the training config (`hf_dflash.trainer.train`); values are JSON (true,
8192, null, "no"), or a bare string such as kl. A later key overrides an earlier one. Used by
`scripts/train_on_gpu.py --variant` and the recipe benchmarks under `benchmarks/training/`.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["bf16_drafter_folder", "parse_variant", "starting_drafter", "variant_name", "with_base"]

SECTIONS = ("drafter", "training", "data")


def parse_variant(spec: str) -> tuple[str, dict[str, dict]]:
    """ "NAME:key=value,training.key=value,data.key=value" -> (NAME, {"drafter": {...}, "training": {...},
    "data": {...}}); a bare key is a drafter (DFlashConfig) field; values are JSON (true, 8192, "kl")."""
    name, _, items = spec.partition(":")
    sections: dict[str, dict] = {section: {} for section in SECTIONS}
    for item in filter(None, items.split(",")):
        key, _, value = item.partition("=")
        section, _, field = key.rpartition(".")
        if (section or "drafter") not in sections:
            raise ValueError(f"variant {name}: {key!r} must be a drafter field or start with training. or data.")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value  # a bare string such as kl
        sections[section or "drafter"][field] = parsed
    return name, sections


def variant_name(spec: str) -> str:
    """The NAME of "NAME:overrides"."""
    return parse_variant(spec)[0]


def with_base(spec: str, base: str) -> str:
    """ "NAME:overrides" with `base` first (a later key overrides an earlier one). A variant that starts
    from a saved drafter (init_from) keeps its architecture: only the base's training./data. keys apply to it."""
    name, _, items = spec.partition(":")
    base_items = base.split(",") if base else []
    if "init_from=" in items:
        base_items = [item for item in base_items if "." in item.partition("=")[0]]
    return f"{name}:{','.join(filter(None, [*base_items, items]))}"


def starting_drafter(spec: str) -> str | None:
    """The folder a warm-started variant continues from (its init_from), else None (from scratch)."""
    return parse_variant(spec)[1]["drafter"].get("init_from")


def bf16_drafter_folder(out_dir: str | Path, name: str) -> Path:
    """Where a variant run in `out_dir` saves its final drafter, Hub-native in bf16 (OUT/drafters/NAME-bf16)."""
    return Path(out_dir) / "drafters" / f"{name}-bf16"
