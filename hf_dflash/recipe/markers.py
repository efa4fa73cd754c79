"""What the recipe owns and what it has finished: `OUT/recipe.json` says a folder is the recipe's, and
`OUT/stages/<stage>.json` (written atomically, last) says a stage is complete, with the settings it ran with.

A stage is complete only when its marker exists and its fingerprint (its own settings chained with those of
every stage before it) equals this run's: a half-written output has no marker, so it is resumed or redone,
never taken as complete; a changed setting is refused with the keys that changed and the `--redo` that
re-runs the stage explicitly.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from ..folder_lock import LOCK_NAME
from ..json_files import is_atomic_temporary, write_json_atomic

__all__ = ["MADE_BY", "check_recipe_folder", "fingerprint", "read_marker", "stage_state", "write_marker"]

OWNER_FILE = "recipe.json"
STAGES_DIR = "stages"
MADE_BY = "hf-dflash recipe"


def check_recipe_folder(out: Path) -> None:
    """ValueError when `out` is a file, or a non-empty folder that the recipe did not make."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a new folder, or one an earlier recipe run made.")
    if not out.is_dir():
        return
    # Under `accelerate launch` the other processes check --out while the main one writes recipe.json atomically,
    # and a run killed mid-claim leaves that temporary behind: it is the recipe's own.
    held = sorted(
        path.name for path in out.iterdir() if path.name != LOCK_NAME and not is_atomic_temporary(path.name, OWNER_FILE)
    )
    if not held:
        return
    try:
        owner = json.loads((out / OWNER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        owner = None
    if not isinstance(owner, dict) or owner.get("made_by") != MADE_BY:
        shown = ", ".join(held[:6]) + (" ..." if len(held) > 6 else "")
        raise ValueError(
            f"--out {out} holds files the recipe did not make ({shown}); give a new or empty folder "
            "(the recipe writes and deletes stage outputs inside it)."
        )


def claim_folder(out: Path, target: str) -> None:
    """Write `OUT/recipe.json` (once): the folder is the recipe's from now on."""
    if not (out / OWNER_FILE).is_file():
        write_json_atomic(out / OWNER_FILE, {"made_by": MADE_BY, "target": target})


def fingerprint(settings: dict, upstream: str) -> str:
    """sha256 of a stage's settings chained with the fingerprint of the stages before it."""
    text = json.dumps(settings, sort_keys=True, default=str) + upstream
    return hashlib.sha256(text.encode()).hexdigest()


def marker_path(out: Path, stage: str) -> Path:
    return out / STAGES_DIR / f"{stage}.json"


def read_marker(out: Path, stage: str) -> dict | None:
    try:
        marker = json.loads(marker_path(out, stage).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and "fingerprint" in marker else None


def write_marker(out: Path, stage: str, settings: dict, print_: str, seconds: float, outputs: dict) -> None:
    record = {"stage": stage, "fingerprint": print_, "settings": settings, "seconds": round(seconds, 2)}
    write_json_atomic(marker_path(out, stage), {**record, "outputs": outputs})


def stage_state(out: Path, stage: str, settings: dict, print_: str) -> str:
    """The stage's state: "done" (complete with these settings) or "todo"; ValueError when it completed with
    other settings (naming the keys that changed and the way out)."""
    marker = read_marker(out, stage)
    if marker is None:
        return "todo"
    if marker["fingerprint"] == print_:
        return "done"
    old = json.loads(json.dumps(marker.get("settings", {}), default=str))
    new = json.loads(json.dumps(settings, default=str))
    changed = sorted(key for key in old.keys() | new.keys() if old.get(key) != new.get(key))
    what = (
        "settings changed: " + ", ".join(f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in changed)
        if changed
        else "the settings of an earlier stage changed"
    )
    raise ValueError(
        f"stage {stage} in {out} was completed with other settings ({what}). Run with the settings it was made "
        f"with, pass --redo {stage} to delete its output and re-run it and every later stage, or use a new --out."
    )


def forget(out: Path, stages: list[str], outputs: dict[str, list[str]]) -> None:
    """Delete the markers and outputs of `stages` (all the recipe's own, inside `out`)."""
    for stage in stages:
        marker_path(out, stage).unlink(missing_ok=True)
        for relative in outputs.get(stage, []):
            remove_output(out / relative)


def remove_output(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
