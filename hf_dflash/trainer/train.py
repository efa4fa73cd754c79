"""`hf-dflash train --config FILE.yaml`: build target, drafter, data and trainer from one config.

```yaml
target: smollm2-135m-instruct     # a known name (hf_dflash.targets) or a local Transformers folder
target_dtype: auto                # dtype of the frozen target (auto: bf16 where the hardware has it, else fp32)
drafter:                          # DFlashConfig.from_target_config arguments, or init_from: FOLDER
                                  # (+ upgrade_to_dflash2: {selector_rank: 64, ...}: DFlash2 parts at identity)
  num_hidden_layers: 3
  num_target_features: 5
data:
  tokenized: out/data/tokenized   # tokenized-*.jsonl shards (hf-dflash prepare-data), or a packed folder
  features: out/features          # cached features, used when training.feature_mode is offline
  eval_samples: 32                # held out from the end of the data for evaluation
  eval_part: null                 # optional, packed folders: hold out the first eval_samples of this part
  max_train_samples: null         # optional: train on the first N samples only (learning curves)
  parts: null                     # optional, packed folders: use only these parts
lora: null                        # e.g. {r: 16, lora_alpha: 32, target_modules: [q_proj, v_proj]}
training:                         # DFlashTrainingArguments fields
  output_dir: out/drafter
  block_size: 16
  num_anchors: 64
```
The whole file is validated before anything is loaded (`config_schema`: every unknown key, wrong type
and missing key, one line each). `training.seed` also seeds the drafter's initialisation. A run whose
`output_dir` already holds checkpoints resumes from the last *complete* one (a checkpoint interrupted
while it was written is skipped, and named); a run that already finished with the same config is left
alone (`finished_run.json`). The final drafter (LoRA merged) is saved Hub-native in `output_dir`.
"""

import json
import pickle
import re
from pathlib import Path

import yaml
from safetensors import SafetensorError, safe_open
from torch.utils.data import Subset
from transformers import set_seed
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..checkpoints import load_drafter
from ..data.packed import PackedDataset, is_packed, source_of
from ..data.tokenized import TokenizedDataset
from ..folder_lock import LOCK_NAME, folder_lock
from ..hub_cards import TrainingRecordCallback, record_data_from_prepare_data
from ..json_files import is_atomic_temporary, write_json_atomic
from ..modeling_dflash import DFlashConfig, DFlashDraftModel
from ..packaged_files import file_sha256
from ..targets import load_any_target
from .arguments import DFlashTrainingArguments
from .config_schema import validate_train_config
from .draft_vocab import draft_vocab_report, select_draft_vocab, supervised_token_counts
from .initialization import init_from_target
from .trainer import DFlashTrainer
from .upgrade import dflash2_from_dflash

FINISHED_RUN_NAME = "finished_run.json"
STARTED_RUN_NAME = "training_started.json"  # written first into output_dir: the folder is a training's own
TRAINER_STATE_NAME = "trainer_state.json"
WEIGHT_NAMES = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors")
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


class DuplicateKeyError(yaml.YAMLError):
    """A key repeated in one YAML mapping."""


class UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key repeated in one mapping: PyYAML keeps the last value without a word,
    so `learning_rate: 1e-3` twice in a section trained with whichever came last. Keys merged in with `<<` may
    still be overridden (that is what a merge is for)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first_line: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    line = first_line.setdefault(key, key_node.start_mark.line + 1)
                except TypeError:  # an unhashable key: the base class names it
                    continue
                if line != key_node.start_mark.line + 1:
                    raise DuplicateKeyError(
                        f"key {key!r} appears twice in one mapping (lines {line} and {key_node.start_mark.line + 1}); "
                        "YAML would keep the second value silently: delete the one you do not mean."
                    )
        return super().construct_mapping(node, deep)


def read_yaml(path: str | Path):
    """The YAML document in `path`, read safely; ValueError naming the file for invalid YAML or a repeated key."""
    try:
        return yaml.load(Path(path).read_text(encoding="utf-8"), Loader=UniqueKeyLoader)  # a SafeLoader
    except DuplicateKeyError as error:
        raise ValueError(f"{path}: {error}") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path} is not valid YAML: {error}") from None


def load_train_config(path: str | Path) -> dict:
    """Read the YAML training config (`read_yaml`: a repeated key is an error) and validate all of it
    (`validate_train_config`)."""
    return validate_train_config(read_yaml(path), str(path))


def checkpoint_problem(folder: Path) -> str | None:
    """Why a `checkpoint-N` folder cannot be resumed from (None when complete). The Trainer writes the
    weights first and `trainer_state.json` last, so an interrupted save lacks (or truncates) the latter."""
    state_file = folder / TRAINER_STATE_NAME
    weights = [folder / name for name in WEIGHT_NAMES if (folder / name).is_file()]
    if not weights:
        return "no weights"
    for path in weights:
        if path.suffix == ".safetensors":
            try:
                with safe_open(str(path), framework="pt"):
                    pass
            except Exception as error:  # safetensors raises its own SafetensorError (and OSError)
                return f"unreadable {path.name} ({type(error).__name__}: truncated or corrupt)"
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"no {TRAINER_STATE_NAME}"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return f"unreadable {TRAINER_STATE_NAME}"
    if not isinstance(state, dict) or "global_step" not in state:
        return f"{TRAINER_STATE_NAME} without global_step"
    return None


def last_complete_checkpoint(output_dir: Path) -> tuple[Path | None, dict[str, str]]:
    """(the newest complete checkpoint folder or None, {skipped newer folder name: why})."""
    if not output_dir.is_dir():
        return None, {}
    found = [(int(m.group(1)), p) for p in output_dir.iterdir() if p.is_dir() and (m := _CHECKPOINT.match(p.name))]
    skipped = {}
    for _, folder in sorted(found, reverse=True):
        problem = checkpoint_problem(folder)
        if problem is None:
            return folder, skipped
        skipped[folder.name] = problem
    return None, skipped


def _json_config(config: dict) -> dict:
    return json.loads(json.dumps(config, default=str))


def finished_run(output_dir: Path, config: dict) -> dict | None:
    """The `finished_run.json` record when `output_dir` holds a finished run of exactly `config`."""
    try:
        record = json.loads((output_dir / FINISHED_RUN_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if (
        isinstance(record, dict)
        and record.get("config") == _json_config(config)
        and (output_dir / "config.json").is_file()
    ):
        return record
    return None


def output_dir_problem(output_dir: Path) -> str | None:
    """Why training must not write into `output_dir` (None when it may): it holds files that no
    `hf-dflash train` run made. Training's own folders hold `training_started.json` (written when a run
    starts), or, from runs before that file existed, `finished_run.json` or `checkpoint-N` folders."""
    if not output_dir.exists():
        return None
    if not output_dir.is_dir():
        return f"training.output_dir {output_dir} is a file, not a folder; give a new or empty folder."
    # the main process's lock, and its marker while it is being written (other processes of the same run look)
    held = sorted(
        path.name
        for path in output_dir.iterdir()
        if path.name != LOCK_NAME and not is_atomic_temporary(path.name, STARTED_RUN_NAME)
    )
    if not held or STARTED_RUN_NAME in held or FINISHED_RUN_NAME in held:
        return None
    if any(_CHECKPOINT.match(name) and (output_dir / name).is_dir() for name in held):
        return None
    shown = ", ".join(held[:6]) + (" ..." if len(held) > 6 else "")
    return (
        f"training.output_dir {output_dir} is not empty and was not made by hf-dflash train (it holds {shown}); "
        "training would replace its weights, config, card and record and leave the rest (e.g. a benchmark.json "
        "of other weights). Give a new or empty output_dir; to continue training this drafter, set "
        f"drafter.init_from: {output_dir} and a new output_dir."
    )


def init_record(section: dict) -> dict | None:
    """The training record's `init_from`: the folder a continued run starts from, its weights' sha256 (a local
    folder with one `model.safetensors`) and the DFlash2 upgrade; None for a run from scratch."""
    if not section.get("init_from"):
        return None
    path = Path(section["init_from"])
    weights = path / "model.safetensors"
    record = {"path": str(section["init_from"])}
    if weights.is_file():
        record["weights_sha256"] = file_sha256(weights)
    if section.get("upgrade_to_dflash2") is not None:
        record["upgrade_to_dflash2"] = dict(section["upgrade_to_dflash2"])
    return record


def build_drafter(section: dict, target, tokenizer, block_size: int) -> DFlashDraftModel:
    section = dict(section or {})
    if init_from := section.pop("init_from", None):
        drafter = load_drafter(init_from)
        if (upgrade := section.pop("upgrade_to_dflash2", None)) is not None:
            drafter = dflash2_from_dflash(drafter, **upgrade)
            print(f"{init_from} upgraded to DFlash2 ({upgrade}), its new parts at identity.")
        if drafter.config.block_size != block_size:
            # The weights do not depend on the block size: continue training them for another one.
            print(f"{init_from} was trained with block_size {drafter.config.block_size}; continuing with {block_size}.")
            drafter.config.block_size = block_size
            if isinstance(drafter.config.block_size_policy, int) and drafter.config.block_size_policy > block_size:
                drafter.config.block_size_policy = None
            drafter.config.validate_dflash()
        return drafter.float()
    from_target = section.pop("init_from_target", False)
    section.setdefault("block_size", block_size)
    if section["block_size"] != block_size:
        raise ValueError(f"drafter.block_size={section['block_size']} differs from training.block_size={block_size}.")
    drafter = DFlashDraftModel(DFlashConfig.from_target_config(target.config, tokenizer=tokenizer, **section))
    if from_target:
        layers = init_from_target(drafter, target, None if from_target is True else list(from_target))
        print(f"Draft layers initialised from target layers {layers} (fc: identity on the deepest feature).")
    return drafter


def build_datasets(section: dict, args: DFlashTrainingArguments, drafter: DFlashDraftModel, vocab_size: int):
    if args.feature_mode == "offline":
        from ..data.feature_cache import OfflineFeatureDataset

        dataset = OfflineFeatureDataset(
            section["features"],
            section["tokenized"],
            target_layer_ids=drafter.config.target_layer_ids,
            hidden_size=drafter.config.target_hidden_size,
            load_teacher=args.loss_type != "ce",  # cross-entropy never reads it
        )
        if args.loss_type != "ce" and not dataset.teacher_top_k:
            raise ValueError(
                f"training.loss_type={args.loss_type!r} offline distils the target's distribution, which the feature "
                f"cache {section['features']} does not hold: re-run hf-dflash cache-features --teacher-top-k 32 "
                "--out <new folder> (or train with loss_type 'ce', or feature_mode 'online')."
            )
    elif is_packed(section["tokenized"]):  # a packed folder (e.g. the repository's data/): token ids + masks
        dataset = PackedDataset(section["tokenized"], vocab_size=vocab_size, parts=section.get("parts"))
    else:
        dataset = TokenizedDataset(section["tokenized"], vocab_size=vocab_size)
    held_out = int(section.get("eval_samples", 0))
    evaluation_indices = held_out_indices(dataset, held_out, section.get("eval_part"), section.get("parts"))
    held = set(evaluation_indices)
    train_indices = [i for i in range(len(dataset)) if i not in held]
    if not train_indices:
        raise ValueError(f"data.eval_samples={held_out} leaves no training data (dataset has {len(dataset)} samples).")
    limit = section.get("max_train_samples")  # the first N training samples (learning curves)
    train = Subset(dataset, train_indices if limit is None else train_indices[: int(limit)])
    evaluation = Subset(dataset, evaluation_indices) if evaluation_indices else None
    return train, evaluation


def held_out_indices(dataset, count: int, part: str | None = None, parts: list[str] | None = None) -> list[int]:
    """Indices of the held-out samples: the first `count` of packed part `part` (a set that stays the same
    when other parts, or later shards of other parts, are added), or without `part` the last `count`
    samples (they move when data is appended)."""
    if part is None:
        return list(range(max(len(dataset) - count, 0), len(dataset)))
    if not isinstance(dataset, PackedDataset):
        raise ValueError(
            f"data.eval_part needs a packed folder (hf-dflash pack-data); {dataset.__class__.__name__} has no parts."
        )
    if part not in dataset.part_names:
        raise ValueError(
            f"data.eval_part={part!r}: the packed folder has no such part; it has {', '.join(dataset.part_names)}."
        )
    if parts is not None and part not in parts:
        raise ValueError(f"data.eval_part={part!r} is not among data.parts={parts}; add it there.")
    indices = [i for i, name in enumerate(dataset.parts) if name == part]
    if not 1 <= count <= len(indices):
        raise ValueError(
            f"data.eval_samples={count} must be between 1 and the size of part {part}: {part} has {len(indices)} samples."
        )
    return indices[:count]


def choose_draft_vocab(drafter: DFlashDraftModel, train, target) -> dict:
    """Set the drafter's draft vocabulary to the most frequent supervised tokens of `train` (EOS ids kept);
    returns its `draft_vocab_report`."""
    vocab_size = drafter.config.vocab_size
    counts = supervised_token_counts((train[i] for i in range(len(train))), vocab_size)
    eos = target.generation_config.eos_token_id if target.generation_config is not None else None
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    ids = select_draft_vocab(counts, drafter.config.draft_vocab_size, always=eos)
    drafter.set_draft_vocab(ids)
    return draft_vocab_report(counts, ids)


def train_from_config(config: dict, callbacks: list | None = None) -> DFlashTrainer | None:
    """Run (or resume) a training described by a config dict; returns the finished trainer, or None
    (and says so) when `output_dir` already holds a finished run of the same config.
    `callbacks` (`TrainerCallback`s) are added to the trainer's own."""
    config = validate_train_config(config)
    output_dir = Path(config["training"]["output_dir"])
    if (record := finished_run(output_dir, config)) is not None:
        print(
            f"Training already finished: {output_dir} holds a finished run of this config (step "
            f"{record.get('global_step')}); leaving it alone. Change the config (e.g. max_steps) to continue it, "
            "or use a new output_dir."
        )
        return None
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(output_dir_problem(output_dir))
    # The card's base_model: the target as named in the config, not its cache folder.
    args = DFlashTrainingArguments(**{"target_name_or_path": config["target"], **config["training"]})
    if args.process_index != 0:  # the main process holds the folder's lock and writes the records
        if (problem := output_dir_problem(output_dir)) is not None:
            raise ValueError(problem)
        return _train(config, args, output_dir, callbacks)
    # The lock first, then the look inside: a second run started at the same time is told that another process
    # writes there (it used to see the first run's temporary marker and call the folder foreign).
    with folder_lock(output_dir, "training.output_dir"):
        if (problem := output_dir_problem(output_dir)) is not None:
            raise ValueError(problem)
        write_json_atomic(output_dir / STARTED_RUN_NAME, {"made_by": "hf-dflash train", "config": _json_config(config)})
        return _train(config, args, output_dir, callbacks)


def _train(config: dict, args: DFlashTrainingArguments, output_dir: Path, callbacks: list | None):
    resume, skipped = last_complete_checkpoint(output_dir)
    if args.process_index == 0 and skipped:
        print(
            "Skipping incomplete checkpoint(s) "
            + ", ".join(f"{name} ({why}: interrupted while saving?)" for name, why in skipped.items())
            + (f"; resuming from {resume.name}." if resume is not None else "; starting from scratch.")
        )
    target, tokenizer = load_any_target(config["target"], config.get("target_dtype", "auto"))
    set_seed(args.seed)  # the drafter's initialisation follows training.seed (the Trainer seeds only later)
    drafter = build_drafter(config.get("drafter"), target, tokenizer, args.block_size)
    model = drafter
    if config.get("lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(drafter, LoraConfig(**config["lora"]))
    train, evaluation = build_datasets(config["data"], args, drafter, target.get_input_embeddings().weight.shape[0])
    draft_vocab = None
    if drafter.config.draft_vocab_size is not None and not (config.get("drafter") or {}).get("init_from"):
        draft_vocab = choose_draft_vocab(drafter, train, target)
        print(
            f"Draft vocabulary: {draft_vocab['draft_vocab_size']} ids cover {draft_vocab['coverage']:.2%} of the "
            f"{draft_vocab['supervised_tokens']} supervised training tokens (sizes per coverage: "
            f"{draft_vocab['size_for_coverage']})"
        )
    record = TrainingRecordCallback(
        **(
            packed_data_record(train)
            if is_packed(config["data"]["tokenized"]) and config["training"].get("feature_mode", "online") == "online"
            else training_data_record(Path(config["data"]["tokenized"]), len(train))
        ),
        **({"draft_vocab": draft_vocab} if draft_vocab else {}),
        init_from=init_record(config.get("drafter") or {}),
    )
    trainer = DFlashTrainer(
        model, args, target=target, train_dataset=train, eval_dataset=evaluation, callbacks=[record, *(callbacks or [])]
    )
    if config.get("lora") and trainer.is_fsdp_enabled:
        raise ValueError(
            "lora with FSDP: merging LoRA into a sharded drafter is not supported here; train LoRA with DDP "
            "(accelerate launch --multi_gpu), whose drafter replicas fit any GPU that fits the target."
        )
    try:
        trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
    except (SafetensorError, pickle.UnpicklingError, EOFError) as error:
        if resume is None:
            raise
        raise ValueError(
            f"Cannot resume from {resume}: a file in it is unreadable or refused by torch.load ({type(error).__name__}: "
            f"{str(error)[:200]}). Delete {resume} to resume from the checkpoint before it, or use a new output_dir."
        ) from error
    if config.get("lora"):
        final = model.merge_and_unload()
        if trainer.is_world_process_zero():
            final.save_pretrained(args.output_dir)
    else:
        trainer.save_drafter(args.output_dir)  # every process: FSDP gathers the shards first
    if trainer.is_world_process_zero():
        trainer.create_model_card()
    if args.push_to_hub:
        trainer.push_to_hub()
    if trainer.is_world_process_zero():  # written last: its presence means the run is complete
        record = {"config": _json_config(config), "global_step": trainer.state.global_step}
        write_json_atomic(output_dir / FINISHED_RUN_NAME, record)
    return trainer


def training_data_record(tokenized: Path, num_samples: int) -> dict:
    """What the training record says about the data: per-source counts from an `hf-dflash prepare-data`
    folder when `tokenized` lives in one, else the folder name and the sample count."""
    if (tokenized.parent / "corpus" / "summary.json").is_file():
        return record_data_from_prepare_data(tokenized.parent)
    return {"data_sources": {tokenized.name: num_samples}, "num_samples": num_samples}


def packed_data_record(train) -> dict:
    """Per-source sample and supervised-token counts of the training split of a packed folder."""
    sources: dict[str, int] = {}
    supervised = 0
    for index in range(len(train)):
        item = train[index]
        sources[source_of(item["id"])] = sources.get(source_of(item["id"]), 0) + 1
        supervised += sum(item["loss_mask"])
    return {"data_sources": dict(sorted(sources.items())), "num_samples": len(train), "supervised_tokens": supervised}
