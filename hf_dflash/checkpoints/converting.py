"""Converting a drafter checkpoint from any loadable format to "official", "hub" or "speculators" (`hf-dflash convert`)."""

from __future__ import annotations

import os
import shutil
import tempfile
from functools import partial
from pathlib import Path

import torch

from ..folder_lock import path_lock
from ..json_files import read_json_object
from .files import CONFIG_NAME
from .hub import save_hub
from .loading import load_drafter
from .official import save_official
from .speculators import save_speculators, speculators_refusal
from .vocabulary import expand_draft_vocabulary

FORMATS = ("official", "hub", "speculators")  # the formats written


def official_head_source(model, target):
    """What `save_official(model, ..., target_lm_head=)` needs: None without a draft vocabulary (the target is not
    loaded then); else `target` itself, or for a known target's name or Hub id, a local model folder or another
    Hub id, that target loaded in fp32 (exact for a bf16 or fp32 checkpoint; the written weights are cast after)."""
    if model.config.draft_vocab_size is None or target is None:
        return None
    if not isinstance(target, (str, os.PathLike)):
        return target
    from ..targets import KNOWN_TARGETS, load_any_target

    name = str(target)
    name = next((known for known, spec in KNOWN_TARGETS.items() if spec.hub_id == name), name)
    if name in KNOWN_TARGETS or Path(name).is_dir():
        return load_any_target(name, dtype=torch.float32)[0]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)  # a Hub id


def speculators_verifier(target) -> tuple[str, list[str]]:
    """(name_or_path, architectures) of the verifier a speculators export names, from `target`: a known target's
    name -> its Hub id; a local model folder -> its absolute path and its config.json's architectures; another
    string -> a Hub id as given; a model -> its `name_or_path` and config architectures."""
    if target is None:
        raise ValueError(
            "A speculators export names its verifier (speculators loads the embedding, LM head and final norm from "
            "it): pass --target with a known target's name, a local model folder or the target's Hub id "
            "(convert(..., target=...))."
        )
    if not isinstance(target, (str, os.PathLike)):
        name = getattr(target, "name_or_path", "") or getattr(target.config, "_name_or_path", "")
        if not name:
            raise ValueError("The target model records no name_or_path: pass its Hub id or local folder instead.")
        return str(name), list(target.config.architectures or [])
    from ..targets import KNOWN_TARGETS

    name = str(target)
    if name in KNOWN_TARGETS and KNOWN_TARGETS[name].hub_id:
        return KNOWN_TARGETS[name].hub_id, []
    folder = Path(name)
    if folder.is_dir():
        config = read_json_object(folder / CONFIG_NAME, "config") if (folder / CONFIG_NAME).is_file() else {}
        return str(folder.resolve()), list(config.get("architectures") or [])
    return name, []


def speculators_writer(model, target):
    """`save_speculators` bound to the verifier and head rows `target` gives, or the ValueError naming why this
    drafter has no speculators layout (before a target is loaded)."""
    refusal = speculators_refusal(model.config)
    if refusal is not None:
        raise ValueError(f"This drafter has no speculators layout: {refusal}.")
    verifier, architectures = speculators_verifier(target)
    head = official_head_source(model, target)
    return partial(save_speculators, verifier=verifier, verifier_architectures=architectures, target_lm_head=head)


def check_destination(src: str | os.PathLike, dst: Path, overwrite: bool) -> None:
    """Refuse to write over another checkpoint (its stale files would stay beside ours) unless
    `overwrite`, and never replace a folder that holds the source."""
    source = Path(src).resolve() if Path(src).exists() else None
    if source is not None and dst.exists() and (source == dst.resolve() or dst.resolve() in source.parents):
        raise ValueError(f"The destination {dst} is or holds the source {src}; write the conversion elsewhere.")
    if dst.is_file():
        raise ValueError(f"The destination {dst} is a file; give a new or empty folder.")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        held = sorted(p.name for p in dst.iterdir())
        raise ValueError(
            f"The destination {dst} is not empty (it holds {held[:6]}{' ...' if len(held) > 6 else ''}); give a new or "
            "empty folder, or pass --overwrite (overwrite=True) to replace the whole folder."
        )


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    to: str,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    num_target_layers: int | None = None,
    target=None,
    expand_vocabulary: bool = False,
) -> Path:
    """Convert a drafter checkpoint (any loadable format) to `to` = "official", "hub" or "speculators" in `dst`.

    `dst` must be new or empty unless `overwrite`, which replaces the whole folder (the conversion is
    written beside it first, so a failure leaves the old folder as it was). `dtype` casts the written
    weights (default: keep). `num_target_layers`: the target's depth, for speculators sources. `target`: for
    a drafter with a pruned draft vocabulary, the target (a model, a known target's name or a local model folder)
    whose LM-head rows the official or speculators export holds (`save_official`); for `to="speculators"`, always:
    the verifier it names (`speculators_verifier`). `expand_vocabulary`: write a drafter with a pruned draft
    vocabulary as one that drafts over the target's whole vocabulary (`expand_draft_vocabulary`: its drafts change;
    the only official or speculators layout of a pruned DFlash2 drafter). Returns `dst`.
    """
    if to not in FORMATS:
        raise ValueError(f"to={to!r} is not a checkpoint format; use one of {FORMATS}.")
    destination = Path(dst)
    check_destination(src, destination, overwrite)
    # One writer per destination; the lock lies beside it (--overwrite replaces the folder whole).
    with path_lock(destination, "convert", kind="folder"):
        check_destination(src, destination, overwrite)  # again: another conversion may have just finished
        model = load_drafter(src, num_target_layers=num_target_layers)
        if expand_vocabulary:
            model = expand_draft_vocabulary(model)
        if to == "official":
            save = partial(save_official, target_lm_head=official_head_source(model, target))
        elif to == "speculators":
            save = speculators_writer(model, target)
        else:
            save = save_hub
        if not (destination.is_dir() and any(destination.iterdir())):
            return save(model, destination, dtype=dtype)
        staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", dir=destination.parent))
        try:
            save(model, staging / "new", dtype=dtype)
            os.replace(destination, staging / "old")
            os.replace(staging / "new", destination)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return destination


__all__ = ["FORMATS", "check_destination", "convert", "official_head_source", "speculators_verifier"]
