"""`hf-dflash recipe`: every stage from a causal-LM target to an exported drafter, resumable.

One progress line per stage (with a rough ETA from one timed target forward), one summary table at the end.
Under `accelerate launch` every process runs the recipe: the main process runs every stage; the others wait
for the data stages' markers, join the training (the same `train_from_config` as `hf-dflash train`) and stop.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..folder_lock import folder_lock
from ..interrupts import raise_if_interrupted
from ..output_paths import check_output_folder
from .checks import check_drafter_for_target
from .config import TRAINING_DEFAULTS, load_recipe_config
from .defaults import derive_defaults
from .markers import (
    check_recipe_folder,
    claim_folder,
    fingerprint,
    forget,
    read_marker,
    remove_output,
    stage_state,
    write_marker,
)
from .stages import PATHS, STAGES, RecipeRun

__all__ = ["run_recipe"]

WAIT_SECONDS = 2.0


def train_config_for(config: dict, derived: list, out: Path) -> dict:
    """The `hf-dflash train` config of the training stage, validated by train's own schema."""
    import torch

    from ..trainer.config_schema import validate_train_config

    values = {setting.name: setting.value for setting in derived}
    drafter = dict(config["drafter"])
    if "init_from" not in drafter:
        drafter.setdefault("num_hidden_layers", values["num_hidden_layers"])
        drafter.pop("num_target_features", None)
        drafter["target_layer_ids"] = values["target_layer_ids"]
        if values["draft_vocab_size"] is not None:
            drafter["draft_vocab_size"] = values["draft_vocab_size"]
    offline = config["features"]["enabled"]
    training = {**TRAINING_DEFAULTS, "seed": config["seed"], **config["training"]}
    if "max_steps" in config["training"] and "num_train_epochs" not in config["training"]:
        del training["num_train_epochs"]  # a step count replaces the default epochs
    training.update(output_dir=str(out / PATHS["drafter"]), block_size=values["block_size"])
    training.setdefault("feature_mode", "offline" if offline else "online")
    if not torch.cuda.is_available():
        training.setdefault("use_cpu", True)
    data = {
        "tokenized": str(out / PATHS["tokenized" if offline else "packed"]),
        "eval_samples": config["data"]["eval_samples"],
    }
    if offline:
        data["features"] = str(out / PATHS["features"])
    train = {"target": config["target"], "target_dtype": config["dtype"], "drafter": drafter, "data": data,
             "training": training}  # fmt: skip
    return validate_train_config(train, "recipe config (its drafter/training sections)")


def plan(config: dict, out: Path) -> RecipeRun:
    """The run: derived settings (printed with their reasons) and the training config, checked before any stage."""
    from transformers import AutoConfig

    from ..data.pipeline import check_prepare_settings
    from ..targets import default_cache_dir, load_target

    data = config["data"]
    check_prepare_settings(**{k: data[k] for k in ("max_prompts", "temperature", "max_new_tokens", "batch_size",
                                                   "shard_size", "max_length", "max_prompt_tokens")})  # fmt: skip
    name = config["target"]
    folder = Path(name) if Path(name).is_dir() else default_cache_dir() / name
    if not (folder / "config.json").is_file():
        load_target(name)  # a known target converted once (as every command does)
    target_config = AutoConfig.from_pretrained(folder)
    derived = derive_defaults(target_config, config["drafter"], config["training"])
    run = RecipeRun(out, config, derived, train_config_for(config, derived, out))
    check_drafter_for_target(run.train_config, target_config)
    return run


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "under a minute"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"~{hours}h{minutes:02d}m" if hours else f"~{minutes}m{secs:02d}s" if minutes else f"~{secs}s"


def _prints(run: RecipeRun) -> list[tuple]:
    """(stage, settings, fingerprint, enabled) for every stage, fingerprints chained in order."""
    rows, upstream = [], ""
    for stage in STAGES:
        enabled = stage.enabled(run)
        settings = stage.settings(run) if enabled else {"enabled": False}
        upstream = fingerprint(settings, upstream)
        rows.append((stage, settings, upstream, enabled))
    return rows


def _redo(run: RecipeRun, redo: str | None) -> None:
    if redo is None:
        return
    names = [stage.name for stage in STAGES]
    later = names[names.index(redo) :]
    forget(run.out, later, {stage.name: [PATHS[stage.output]] for stage in STAGES})
    print(f"--redo {redo}: deleted the output and markers of {', '.join(later)}")


def _run_stage(run: RecipeRun, index: int, stage, settings: dict, print_: str) -> tuple:
    """Run `stage` unless its marker says it is complete; returns its summary row."""
    prefix = f"[{index}/{len(STAGES)}] {stage.name:<10}"
    raise_if_interrupted(f"before the {stage.name} stage")
    if stage_state(run.out, stage.name, settings, print_) == "done":
        result = (read_marker(run.out, stage.name).get("outputs") or {}).get("result", "")
        print(f"{prefix} done already ({stage.does}): skipped", flush=True)
        return stage.name, "skipped: done", "-", 0.0, result
    output = run.out / PATHS[stage.output]
    resumed = stage.resumable and output.exists()
    if not stage.resumable:
        remove_output(output)  # an interrupted, non-resumable stage starts again from an empty output
    eta = _eta(stage.estimate(run))
    print(f"{prefix} {stage.does}{' (resuming)' if resumed else ''}, rough ETA {eta}", flush=True)
    start = time.perf_counter()
    result = stage.run(run)
    seconds = time.perf_counter() - start
    write_marker(run.out, stage.name, settings, print_, seconds, {"path": PATHS[stage.output], "result": result})
    print(f"{prefix} done in {seconds:.1f}s: {result}", flush=True)
    return stage.name, "resumed" if resumed else "ran", eta, seconds, result


def _summary(rows: list[tuple], out: Path) -> str:
    lines = ["| stage | status | ETA | time | result |", "|---|---|---|---|---|"]
    for name, status, eta, seconds, result in rows:
        lines.append(f"| {name} | {status} | {eta} | {seconds:.1f}s | {result} |")
    return f"\nRecipe summary ({out}):\n" + "\n".join(lines)


def _print_settings(run: RecipeRun) -> None:
    print(f"Recipe for {run.config['target']} into {run.out}; settings for this target:")
    for setting in run.derived:
        print(f"  {setting.line()}")


def _main_process(run: RecipeRun, redo: str | None) -> int:
    claim_folder(run.out, run.config["target"])
    _redo(run, redo)
    _print_settings(run)
    stages = _prints(run)
    for stage, settings, print_, enabled in stages:  # a changed setting is refused before any stage runs
        if enabled:
            stage_state(run.out, stage.name, settings, print_)
    rows = []
    for index, (stage, settings, print_, enabled) in enumerate(stages, start=1):
        if not enabled:
            print(f"[{index}/{len(STAGES)}] {stage.name:<10} off in the config: skipped", flush=True)
            rows.append((stage.name, "off", "-", 0.0, ""))
            continue
        rows.append(_run_stage(run, index, stage, settings, print_))
    print(_summary(rows, run.out))
    print(f"Exported drafter: {run.out / PATHS['export']}")
    return 0


def _other_process(run: RecipeRun) -> int:
    """A non-main process of `accelerate launch`: wait for the data stages, then train alongside the main one."""
    from ..trainer.train import train_from_config

    waiting = [(stage, settings, print_) for stage, settings, print_, enabled in _prints(run) if enabled]
    waiting = waiting[: [stage.name for stage, _, _ in waiting].index("train")]
    while not all(stage_state(run.out, stage.name, s, p) == "done" for stage, s, p in waiting):
        time.sleep(WAIT_SECONDS)
    train_from_config(run.train_config)
    import torch.distributed as distributed

    if distributed.is_available() and distributed.is_initialized():
        # Left to the interpreter's teardown, the gloo group aborted this process in a full test run on a 2-core
        # AMD EPYC (torch 2.13: "terminate called without an active exception", SIGABRT) while the main process
        # was still benchmarking, and torchrun then killed the main process: leave the group before exiting.
        distributed.destroy_process_group()
    return 0


def run_recipe(
    out: str | Path,
    target: str | None = None,
    config_path: str | Path | None = None,
    max_prompts: int | None = None,
    target_id: str | None = None,
    redo: str | None = None,
) -> int:
    """Run (or resume) the recipe into `out`; see the module docstring. ValueError for bad input, before
    anything is loaded or written."""
    config = load_recipe_config(config_path, target, max_prompts, target_id)
    if redo is not None and redo not in [stage.name for stage in STAGES]:
        raise ValueError(f"--redo {redo!r}: not a stage; stages: {', '.join(stage.name for stage in STAGES)}.")
    out = check_output_folder(out)
    check_recipe_folder(out)
    if int(os.environ.get("RANK", "0")) > 0:  # accelerate launch: the main process owns the folder
        return _other_process(plan(config, out))
    with folder_lock(out, "recipe --out"):  # one recipe per folder; also the write probe, before any model loads
        check_recipe_folder(out)
        return _main_process(plan(config, out), redo)
