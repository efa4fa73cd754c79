"""Writing `training_record.json` (schema: `hf_dflash.hub_cards.schemas`) at the end of training.

    from hf_dflash.hub_cards import TrainingRecordCallback, record_data_from_prepare_data

    callback = TrainingRecordCallback(**record_data_from_prepare_data("out/data"), hardware="1x H200")
    trainer = DFlashTrainer(drafter, args, target=target, train_dataset=..., callbacks=[callback])
    trainer.train()   # -> out/drafter/training_record.json, read by `hf-dflash export --training-record`

The recorded time is the wall-clock time of this `train()` call: a run resumed after an interruption
records only the resumed part.
"""

from __future__ import annotations

import enum
import json
import os
import time
from pathlib import Path

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState

from ..json_files import read_json_object, write_atomic
from .schemas import TRAINING_RECORD_NAME, validate_training_record

# TrainingArguments / DFlashTrainingArguments fields copied into the record (those that are set).
RECORDED_ARGUMENTS = (
    "block_size",
    "num_anchors",
    "loss_decay_gamma",
    "anchor_decay_tokens",
    "feature_mode",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "num_train_epochs",
    "max_steps",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "weight_decay",
    "max_grad_norm",
    "optim",
    "bf16",
    "seed",
)
RECORDED_METRICS = ("loss", "tau", "eval_loss", "eval_tau")


def _json_value(value):
    if isinstance(value, enum.Enum):
        return value.value
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def hyperparameters_from_args(args: TrainingArguments) -> dict:
    """The recipe's hyper-parameters from (DFlash)TrainingArguments, plus the global batch size."""
    values = {name: _json_value(getattr(args, name, None)) for name in RECORDED_ARGUMENTS}
    values = {name: value for name, value in values.items() if value is not None}
    if args.max_steps is not None and args.max_steps <= 0:
        values.pop("max_steps", None)  # -1: epochs decide
    values["world_size"] = args.world_size
    values["global_batch_size"] = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    return values


def final_metrics_from_state(state: TrainerState) -> dict:
    """The last logged value of each of RECORDED_METRICS."""
    metrics = {}
    for entry in state.log_history:
        metrics.update({key: entry[key] for key in RECORDED_METRICS if isinstance(entry.get(key), (int, float))})
    return metrics


def record_data_from_prepare_data(data_dir: str | os.PathLike) -> dict:
    """`data_sources`, `num_samples` and `supervised_tokens` from an `hf-dflash prepare-data` folder
    (`corpus/summary.json`: prompts selected per source; `tokenized/summary.json`: samples kept)."""
    folder = Path(data_dir)
    corpus = read_json_object(folder / "corpus" / "summary.json", "prepare-data corpus summary")
    per_source = corpus.get("per_source")
    if not isinstance(per_source, dict):
        raise ValueError(f"{folder / 'corpus' / 'summary.json'} has no per_source counts; re-run prepare-data.")
    data = {"data_sources": {name: counts["selected"] for name, counts in per_source.items() if counts["selected"]}}
    tokenized = folder / "tokenized" / "summary.json"
    if tokenized.is_file():
        summary = read_json_object(tokenized, "prepare-data tokenized summary")
        data.update({key: summary[key] for key in ("supervised_tokens",) if key in summary})
        if "kept" in summary:
            data["num_samples"] = summary["kept"]
    return data


def write_training_record(record: dict, path: str | os.PathLike) -> Path:
    """Validate `record` and write it as JSON (atomically: a crash leaves no half-written file)."""
    validate_training_record(record, str(path))
    out = Path(path)
    write_atomic(out, json.dumps(record, indent=2) + "\n")
    return out


class TrainingRecordCallback(TrainerCallback, ExportableState):
    """Writes `training_record.json` into `args.output_dir` when training ends (main process only).

    `training_time_s` is the wall time of the whole run: each checkpoint's `trainer_state.json` holds the time
    trained so far (this callback's exported state), and a resumed run adds its own to it.

    Args:
        data_sources: samples (prompts) per data source, e.g. `{"sharegpt": 5000, "gsm8k": 3000}`.
        num_samples, supervised_tokens: size of the tokenised training data (optional).
        datasets: Hub dataset ids for the card's `datasets` metadata (optional).
        hardware: free text, e.g. "1x NVIDIA H200" (optional).
        draft_vocab: the pruned draft vocabulary's `draft_vocab_report` (optional).
        init_from: the drafter a continued run started from, `{path, weights_sha256, upgrade_to_dflash2}` (optional).
    """

    def __init__(
        self,
        data_sources: dict[str, int],
        num_samples: int | None = None,
        supervised_tokens: int | None = None,
        datasets: list[str] | None = None,
        hardware: str | None = None,
        draft_vocab: dict | None = None,
        init_from: dict | None = None,
    ):
        optional = {
            "num_samples": num_samples,
            "supervised_tokens": supervised_tokens,
            "datasets": datasets,
            "hardware": hardware,
            "draft_vocab": draft_vocab,
            "init_from": init_from,
        }
        self.fixed = {"data_sources": dict(data_sources), **{k: v for k, v in optional.items() if v is not None}}
        # Check the caller's part now, not after hours of training.
        placeholder = {"hyperparameters": {}, "training_time_s": 0.0}
        validate_training_record({**self.fixed, **placeholder}, "TrainingRecordCallback")
        self.start: float | None = None
        self.earlier_training_time_s = 0.0  # trained before this process: read from the checkpoint resumed
        self.resume_checked = False

    def training_time_s(self) -> float:
        """Seconds trained so far: before a resume, plus this process's since `on_train_begin`."""
        since_start = time.perf_counter() - self.start if self.start is not None else 0.0
        return self.earlier_training_time_s + since_start

    def state(self) -> dict:
        """What `Trainer` saves in each checkpoint's `trainer_state.json` (`ExportableState`)."""
        # `args` recreate this callback (`restore_callback_states_from_checkpoint`): `fixed` holds its arguments
        return {"args": self.fixed, "attributes": {"earlier_training_time_s": round(self.training_time_s(), 3)}}

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        self.start = time.perf_counter()
        self.earlier_training_time_s, self.resume_checked = 0.0, False

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        # The first step sees the state a resumed run loaded (after `on_train_begin`): take its time trained. A
        # checkpoint written before this callback exported state has none; make room for ours, since Trainer
        # (transformers 5.25) raises a KeyError saving a stateful callback its loaded state does not list.
        if self.resume_checked:
            return
        self.resume_checked = True
        if self.start is None:  # a callback Trainer recreated from the checkpoint, after `on_train_begin`
            self.start = time.perf_counter()
        name = type(self).__name__
        saved = state.stateful_callbacks.get(name)
        saved = saved[0] if isinstance(saved, list) and saved else saved
        if state.global_step > 0 and isinstance(saved, dict):
            self.earlier_training_time_s = float(saved.get("attributes", {}).get("earlier_training_time_s", 0.0))
        state.stateful_callbacks.setdefault(name, self.state())

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs):
        if not state.is_world_process_zero or self.start is None:
            return
        record = {
            **self.fixed,
            "hyperparameters": hyperparameters_from_args(args),
            "training_time_s": round(self.training_time_s(), 3),
            "global_steps": state.global_step,
        }
        metrics = final_metrics_from_state(state)
        if metrics:
            record["final_metrics"] = metrics
        write_training_record(record, Path(args.output_dir) / TRAINING_RECORD_NAME)


__all__ = [
    "RECORDED_ARGUMENTS",
    "TrainingRecordCallback",
    "final_metrics_from_state",
    "hyperparameters_from_args",
    "record_data_from_prepare_data",
    "write_training_record",
]
