"""The two JSON inputs of a model card, their schemas and their validation.

Benchmark JSON (written by the benchmark command; extra keys are allowed and ignored):

    {"command": "python benchmarks/...",          # the exact command that produced the numbers
     "machine": "1x NVIDIA H200, torch 2.13",     # where it ran
     "settings": {"dtype": "bfloat16", ...},      # anything that changes the numbers
     "sets": {"gsm8k": {"n": 40,                  # prompts in the set
                        "tau": 3.41,              # mean acceptance length
                        "speedup": 2.1,           # dflash_tok_s / plain_tok_s
                        "plain_tok_s": 50.2, "dflash_tok_s": 105.4,
                        "identical": true}}}      # every DFlash output equals plain greedy

`training_record.json` (written at the end of training by `TrainingRecordCallback`, see
`hf_dflash.hub_cards.record`; no other keys are allowed, so a typo is an error):

    {"data_sources": {"sharegpt": 5000, "gsm8k": 3000},  # required: samples (prompts) per source
     "hyperparameters": {"learning_rate": 0.0006, ...},  # required: name -> JSON value
     "training_time_s": 3600.0,                          # required: wall-clock seconds of train()
     "num_samples": 7890,          # optional: training samples (default: sum of data_sources)
     "supervised_tokens": 1234567, # optional: tokens with loss_mask 1
     "datasets": ["openai/gsm8k"], # optional: Hub dataset ids for the card's `datasets` metadata
                                   #           (default: the data_sources names)
     "global_steps": 1200,         # optional: optimizer steps
     "hardware": "1x NVIDIA H200", # optional
     "final_metrics": {"loss": 1.9, "tau": 3.1}}  # optional: name -> number (last logged values)
"""

from __future__ import annotations

import os

from ..json_files import read_json_object

TRAINING_RECORD_NAME = "training_record.json"
BENCHMARK_NAME = "benchmark.json"
BENCHMARK_FIELDS = {"command": str, "machine": str, "settings": dict, "sets": dict}
BENCHMARK_SET_FIELDS = {
    "n": int,
    "tau": float,
    "speedup": float,
    "plain_tok_s": float,
    "dflash_tok_s": float,
    "identical": bool,
}
RECORD_REQUIRED = {"data_sources": dict, "hyperparameters": dict, "training_time_s": float}
RECORD_OPTIONAL = {
    "num_samples": int,
    "supervised_tokens": int,
    "datasets": list,
    "global_steps": int,
    "hardware": str,
    "final_metrics": dict,
    "draft_vocab": dict,  # trainer.draft_vocab.draft_vocab_report: size, coverage, sizes per coverage
    "derived_settings": dict,  # hf-dflash recipe: {name: {value, source ("derived"/"config"), reason}}
    "init_from": dict,  # a continued run: {path, weights_sha256 (local folders), upgrade_to_dflash2 (if any)}
    "averaged_from": list,  # weights averaged after training (scripts/average_drafters.py): [{path, weights_sha256}]
}
_JSON_TYPES = {str: "string", dict: "object", list: "array", int: "integer", float: "number", bool: "boolean"}


def _type_ok(value, expected: type) -> bool:
    if expected is float:  # a JSON number: int or float, never a bool
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


class _Problems:
    """Collects every missing / mistyped field so one error lists them all."""

    def __init__(self):
        self.missing: list[str] = []
        self.mistyped: list[str] = []

    def check(self, mapping: dict, fields: dict[str, type], prefix: str = "", required: bool = True) -> None:
        for name, expected in fields.items():
            if mapping.get(name) is None:
                if required:
                    self.missing.append(prefix + name)
            elif not _type_ok(mapping[name], expected):
                self.wrong(prefix + name, expected, mapping[name])

    def wrong(self, name: str, expected: type, value) -> None:
        self.mistyped.append(f"{name} (a {_JSON_TYPES[expected]}, got {value!r})")

    def raise_if_any(self, source: str, expected: str, extra: list[str] = ()) -> None:
        problems = []
        if self.missing:
            problems.append(f"missing field(s) {', '.join(self.missing)}")
        if self.mistyped:
            problems.append(f"wrong type: {', '.join(self.mistyped)}")
        problems.extend(extra)
        if problems:
            raise ValueError(f"{source}: {'; '.join(problems)}. Expected {expected}.")


def validate_benchmark(data: dict, source: str = "benchmark") -> dict:
    """Check a benchmark dict against the schema; the ValueError names every missing or mistyped
    field (e.g. `sets.gsm8k.tau`). Returns `data`."""
    if not isinstance(data, dict):
        raise ValueError(f"{source} must be a JSON object, got {type(data).__name__}.")
    problems = _Problems()
    problems.check(data, BENCHMARK_FIELDS)
    sets = data.get("sets")
    if isinstance(sets, dict):
        if not sets:
            problems.missing.append("sets.<set_name> (at least one benchmark set)")
        for name, row in sets.items():
            if isinstance(row, dict):
                problems.check(row, BENCHMARK_SET_FIELDS, f"sets.{name}.")
            else:
                problems.wrong(f"sets.{name}", dict, row)
    fields = ", ".join(BENCHMARK_SET_FIELDS)
    problems.raise_if_any(source, f"{{command, machine, settings, sets: {{set_name: {{{fields}}}}}}}")
    return data


def validate_training_record(data: dict, source: str = "training record") -> dict:
    """Check a training record against the schema; the ValueError names every missing, mistyped or
    unknown field. Returns `data`."""
    if not isinstance(data, dict):
        raise ValueError(f"{source} must be a JSON object, got {type(data).__name__}.")
    problems = _Problems()
    problems.check(data, RECORD_REQUIRED)
    problems.check(data, RECORD_OPTIONAL, required=False)
    for name, count in (data.get("data_sources") or {}).items():
        if not _type_ok(count, int) or count < 0:
            problems.mistyped.append(f"data_sources.{name} (a sample count >= 0, got {count!r})")
    for name, value in (data.get("final_metrics") or {}).items():
        if not _type_ok(value, float):
            problems.wrong(f"final_metrics.{name}", float, value)
    for dataset in data.get("datasets") or []:
        if not isinstance(dataset, str) or not dataset:
            problems.mistyped.append(f"datasets entry {dataset!r} (a Hub dataset id such as 'openai/gsm8k')")
    for source in data.get("averaged_from") or []:
        if (
            not isinstance(source, dict)
            or not isinstance(source.get("path"), str)
            or set(source) - {"path", "weights_sha256"}
        ):
            problems.mistyped.append(f"averaged_from entry {source!r} (an object {{path, weights_sha256}})")
    if isinstance(data.get("data_sources"), dict) and not data["data_sources"]:
        problems.missing.append("data_sources.<source> (at least one data source)")
    unknown = sorted(set(data) - set(RECORD_REQUIRED) - set(RECORD_OPTIONAL))
    extra = [f"unknown field(s) {unknown}"] if unknown else []
    allowed = f"required {sorted(RECORD_REQUIRED)}, optional {sorted(RECORD_OPTIONAL)}"
    problems.raise_if_any(source, f"{allowed} (see hf_dflash/hub_cards/schemas.py)", extra)
    return data


def load_benchmark(benchmark: str | os.PathLike | dict) -> dict:
    """A validated benchmark dict from a JSON file (or a dict)."""
    if isinstance(benchmark, dict):
        return validate_benchmark(benchmark)
    return validate_benchmark(read_json_object(benchmark, "benchmark"), str(benchmark))


def load_training_record(record: str | os.PathLike | dict) -> dict:
    """A validated training record from a JSON file (or a dict)."""
    if isinstance(record, dict):
        return validate_training_record(record)
    return validate_training_record(read_json_object(record, "training record"), str(record))


__all__ = [
    "BENCHMARK_FIELDS",
    "BENCHMARK_NAME",
    "BENCHMARK_SET_FIELDS",
    "TRAINING_RECORD_NAME",
    "load_benchmark",
    "load_training_record",
    "validate_benchmark",
    "validate_training_record",
]
