"""`hf-dflash bench` end to end: load, run, summarise, write the report and plots, print the table."""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Sequence
from pathlib import Path

import torch

from ..data.regenerate import prompt_format
from ..dtypes import describe_dtype
from ..folder_lock import folder_lock
from ..generation.policies.block_size import parse_block_size_policy
from ..machine_load import timing_threads
from ..output_paths import check_output_folder
from .loading import check_block_size_policy, load_bench_models, load_bench_target, machine_description
from .methods import METHODS, PROMPT_LOOKUP_NUM_TOKENS, check_methods
from .plots import write_plots
from .prompts import EVAL_SETS, select_prompt_sets
from .report import build_report, format_table, prompts_run_line, write_report
from .runner import run_benchmark
from .summary import summarize

__all__ = ["bench_command_line", "other_dtype", "run_bench"]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def other_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype plain decoding is also timed in: float32 for a half-precision run, bfloat16 for float32."""
    return torch.bfloat16 if dtype == torch.float32 else torch.float32


def bench_command_line(options: dict) -> str:
    """The `hf-dflash bench` command line that reproduces a run with these options (None = left out)."""
    parts = ["hf-dflash", "bench"]
    for key, value in options.items():
        if value is not None:
            text = ",".join(value) if isinstance(value, (list, tuple)) else str(value)
            parts += [f"--{key.replace('_', '-')}", text]
    return shlex.join(parts)


def load_run_models(options: dict, block_size_policy: str):
    """(models, the target in the other dtype for `plain-alt` or None, the dtype of each plain method)."""
    target, dtype = options["target"], options["dtype"]
    models = load_bench_models(target, options["drafter"], dtype=dtype, device=options["device"], seed=options["seed"])
    alt_target = None
    dtypes = {"plain": dtype_name(models.target.dtype)}
    if "plain-alt" in options["methods"]:
        alt_dtype = other_dtype(models.target.dtype)
        alt_target = load_bench_target(target, alt_dtype)[0].to(models.target.device)
        dtypes["plain-alt"] = dtype_name(alt_dtype)
    models.drafter.block_size_policy = parse_block_size_policy(block_size_policy, models.drafter.config.block_size)
    models.drafter.draft_temperature = options.get("draft_temperature")
    return models, alt_target, dtypes


def report_settings(
    options: dict,
    models,
    block_size_policy: str,
    dtype_note: str,
    dtypes: dict,
    warmup_seconds: dict,
    prompts_run: dict,
) -> dict:
    """The settings a report records: the run's options as they resolved on the models loaded."""
    temperature = options["temperature"]
    return {
        "target": options["target"],
        "drafter": models.drafter_description,
        "block_size": models.drafter.config.block_size,
        # our DFlash method only (the built-in loop uses block_size); "recommended" resolved to the config's
        "block_size_policy": block_size_policy
        if block_size_policy != "recommended"
        else f"recommended: {models.drafter.config.block_size_policy or 'trained'}",
        "dtype": dtype_name(models.target.dtype),
        "dtype_choice": dtype_note,
        "prompt_format": prompt_format(models.tokenizer),
        "dtypes": dtypes,  # per plain method; every other method runs in "dtype"
        # each method's first (untimed) call of the run: plain-compiled's compile, reported apart from tok/s
        "warmup_seconds": {method: round(seconds, 2) for method, seconds in warmup_seconds.items()},
        "device": options["device"],
        "max_new_tokens": options["max_new_tokens"],
        "temperature": temperature,
        # under sampling, the temperature our DFlash drafter drafts at (None: the call's; 0: its argmax)
        "draft_temperature": options.get("draft_temperature"),
        "seed": options["seed"],
        "num_prompts": options["num_prompts"],
        "prompts_run": prompts_run,  # {set: [run, of]}
        "methods": list(options["methods"]),
        "prompt_lookup_num_tokens": PROMPT_LOOKUP_NUM_TOKENS,
        "order": "all methods on each prompt before the next, method order rotated per prompt",
        "identity_check": "token for token against plain greedy"
        if temperature <= 0
        else "not applicable: sampling (temperature > 0), outputs legitimately differ",
    }


def room_for_every_graph(limit: int = 64):
    """Dynamo's recompile limit raised for a run whose compiled methods share the target's compiled call: each
    method, width and static cache length is a graph of the same frame, and past the limit (8 in torch 2.13) the
    later ones would run eager unannounced and be timed as compiled."""
    import torch._dynamo

    return torch._dynamo.config.patch(recompile_limit=max(limit, torch._dynamo.config.recompile_limit))


def check_run(methods, block_size_policy: str, drafter: str, out, max_new_tokens: int) -> None:
    """The options checked before any model loads: an unknown method, a block size policy the drafter's config.json
    rules out, an output folder that holds results (before the benchmark, not after it: its results were once lost
    to a FileExistsError), a length below 1."""
    check_methods(methods)
    check_block_size_policy(block_size_policy, drafter)
    check_output_folder(out)
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}.")


def announce(options: dict, models, dtype_note: str, prompts_run: dict) -> None:
    """Print what the run is about to time: models, prompts, methods, decoding and the prompt format."""
    temperature, device = options["temperature"], models.target.device
    print(
        f"Target: {options['target']} ({dtype_note}, {device}). Drafter: {models.drafter_description}.\n"
        f"Prompts run: {prompts_run_line(prompts_run)}"
        + f"; methods {', '.join(options['methods'])}, interleaved per prompt; max {options['max_new_tokens']} new "
        + (
            "tokens, greedy."
            if temperature <= 0
            else f"tokens, sampling at temperature {temperature} (seed {options['seed']})."
        )
        + f"\nPrompt format: {prompt_format(models.tokenizer)}"
    )


def run_bench(
    target: str,
    drafter: str,
    sets: Sequence[str] = tuple(EVAL_SETS),
    prompts: str | None = None,
    num_prompts: int | None = None,
    max_new_tokens: int = 256,
    dtype: str = "auto",
    temperature: float = 0.0,
    seed: int = 0,
    out: str | Path = "out/bench",
    methods: Sequence[str] = METHODS,
    device: str | None = None,
    block_size_policy: str = "recommended",
    draft_temperature: float | None = None,
    progress: bool = True,
) -> dict:
    """Benchmark `methods` with `target` + `drafter` on the sets and/or prompts file; write `out/bench.json`,
    `out/benchmark.json` (model card) and the PNG plots; print the table. Returns the report.
    `num_prompts` (0 = all) per set; None: 8 per built-in set and every prompt of the file. `out` is locked
    while the benchmark runs (`folder_lock`: a second run into it is refused)."""
    options = {
        "target": target,
        "drafter": drafter,
        "sets": list(sets),
        "prompts": prompts,
        "num_prompts": num_prompts,
        "max_new_tokens": max_new_tokens,
        "dtype": dtype,
        "temperature": temperature,
        "seed": seed,
        "out": str(out),
        "methods": list(methods),
        "device": device,
    }
    if block_size_policy != "recommended":
        options["block_size_policy"] = block_size_policy  # the default stays out of the command line
    if draft_temperature is not None:
        options["draft_temperature"] = draft_temperature
    check_run(methods, block_size_policy, drafter, out, max_new_tokens)
    prompt_sets, pool_sizes = select_prompt_sets(sets, prompts, num_prompts, seed)
    prompts_run = {name: [len(records), pool_sizes[name]] for name, records in prompt_sets.items()}
    # One writer per folder, and the lock file is the write probe: a second bench into OUT, or an OUT that
    # cannot be written, is refused before any model loads (both used to lose the run at the end).
    with folder_lock(out, "bench --out"), room_for_every_graph(), contextlib.ExitStack() as stack:
        models, alt_target, dtypes = load_run_models(options, block_size_policy)
        machine_load = stack.enter_context(timing_threads(models.target))  # printed; threads restored after
        options["device"] = str(models.target.device)
        dtype_note = describe_dtype(dtype, models.target.device)
        announce(options, models, dtype_note, prompts_run)
        warmup_seconds: dict[str, float] = {}
        samples = run_benchmark(
            models.target,
            models.tokenizer,
            models.drafter,
            prompt_sets,
            methods,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            progress=progress,
            alt_target=alt_target,
            warmup_seconds=warmup_seconds,
        )
        settings = report_settings(options, models, block_size_policy, dtype_note, dtypes, warmup_seconds, prompts_run)
        summary = summarize(samples, methods, models.drafter.config.block_size)
        report = build_report(
            summary, samples, bench_command_line(options), machine_description(models.target.device), settings
        )
        report["machine_load"] = machine_load
        report["plots"] = [path.name for path in write_plots(summary, out)]
        written = write_report(report, out)
        print(format_table(report))
        print("Wrote " + ", ".join(str(path) for path in written) + f" and {len(report['plots'])} plots to {out}")
        return report
