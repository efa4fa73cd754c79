"""The recipe's stages, each a thin call of the code path its own command uses:

    prompts     build_corpus            (prepare-data)   OUT/data/corpus
    regenerate  regenerate_responses    (prepare-data)   OUT/data/responses
    tokenize    tokenize_responses      (prepare-data)   OUT/data/tokenized
    pack        pack_tokenized          (pack-data)      OUT/data/packed
    features    cache_features          (cache-features) OUT/features        (features.enabled)
    train       train_from_config       (train)          OUT/drafter
    heldout     heldout_tau_row         (heldout_tau.py) OUT/heldout         (heldout.enabled)
    bench       run_bench               (bench)          OUT/bench           (bench.enabled)
    export      export_drafter          (export)         OUT/export

`resumable` stages continue an interrupted run themselves (their code skips finished shards, checkpoints,
feature shards); the others start again from an empty output.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..json_files import read_json_object, read_jsonl, write_json_atomic

__all__ = ["STAGES", "RecipeRun", "Stage"]


@dataclass
class RecipeRun:
    """One recipe run: its folder, resolved config, derived settings and training config, and the target
    (loaded once, when a stage first needs it)."""

    out: Path
    config: dict
    derived: list
    train_config: dict
    _target: tuple | None = field(default=None, repr=False)
    seconds_per_token: float | None = None

    def path(self, name: str) -> Path:
        return self.out / PATHS[name]

    @property
    def data(self) -> dict:
        return self.config["data"]

    def target(self):
        """(target, tokenizer), loaded on first use; a folder without a tokenizer is refused by name."""
        if self._target is None:
            from ..targets import load_any_target

            model, tokenizer = load_any_target(self.config["target"], self.config["dtype"])
            if tokenizer is None:
                raise ValueError(f"Target folder {self.config['target']} has no tokenizer; save one next to the model.")
            self._target = (model, tokenizer)
        return self._target

    def release(self) -> None:
        """Drop the target (training and bench load their own)."""
        self._target = None

    def probe(self) -> float:
        """Seconds per token of one target forward over 128 tokens (timed once): the unit of the rough ETAs."""
        if self.seconds_per_token is None:
            model = self.target()[0]
            ids = torch.randint(0, model.config.get_text_config().vocab_size, (1, 128), device=model.device)
            with torch.no_grad():
                model(ids)  # warm-up
                start = time.perf_counter()
                model(ids)
            self.seconds_per_token = (time.perf_counter() - start) / 128
        return self.seconds_per_token


PATHS = {
    "corpus": "data/corpus",
    "responses": "data/responses",
    "tokenized": "data/tokenized",
    "packed": "data/packed",
    "features": "features",
    "drafter": "drafter",
    "heldout": "heldout",
    "bench": "bench",
    "export": "export",
}
# A generated token costs about this many prompt tokens' forward (SmolLM2-135M on 2 CPU cores: ~13x at batch 4,
# ~6x at batch 64, from the regeneration rates measured in regenerate.py)
DECODE_FACTOR = 8


@dataclass(frozen=True)
class Stage:
    name: str
    output: str  # key of PATHS
    does: str
    settings: Callable[[RecipeRun], dict]
    run: Callable[[RecipeRun], str]  # returns a one-line result
    estimate: Callable[[RecipeRun], float | None] = lambda run: None  # rough seconds; None: under a minute
    resumable: bool = False
    enabled: Callable[[RecipeRun], bool] = lambda run: True


def _data_keys(*names: str) -> Callable[[RecipeRun], dict]:
    return lambda run: {name: run.data[name] for name in names}


def _run_prompts(run: RecipeRun) -> str:
    from ..data.corpus import build_corpus

    summary = build_corpus(
        run.path("corpus"), run.data["sources"], prompts_file=run.data["prompts"], max_prompts=run.data["max_prompts"],
        seed=run.config["seed"],
    )  # fmt: skip
    if not summary["num_prompts"]:
        raise ValueError(f"No prompt survived the corpus stage ({run.path('corpus')}/summary.json); add prompts.")
    return f"{summary['num_prompts']} prompts ({summary['num_dropped']} dropped: duplicates or eval overlap)"


def _regenerate_settings(run: RecipeRun) -> dict:
    names = ("temperature", "max_new_tokens", "batch_size", "shard_size", "max_prompt_tokens", "max_length")
    return {"target": run.config["target"], "dtype": run.config["dtype"], "seed": run.config["seed"],
            **{name: run.data[name] for name in names}}  # fmt: skip


def _run_regenerate(run: RecipeRun) -> str:
    from ..data.pipeline import prompt_token_limit
    from ..data.regenerate import regenerate_responses

    model, tokenizer = run.target()
    prompts = list(read_jsonl(run.path("corpus") / "prompts.jsonl"))
    data = run.data
    paths = regenerate_responses(
        model, tokenizer, prompts, run.path("responses"), temperature=data["temperature"],
        max_new_tokens=data["max_new_tokens"], batch_size=data["batch_size"], shard_size=data["shard_size"],
        max_prompt_tokens=prompt_token_limit(data["max_prompt_tokens"], data["max_length"], data["max_new_tokens"]),
        seed=run.config["seed"],
    )  # fmt: skip
    return f"replies to {len(prompts)} prompts in {len(paths)} shard(s)"


def _estimate_regenerate(run: RecipeRun) -> float:
    prompts = sum(1 for _ in read_jsonl(run.path("corpus") / "prompts.jsonl"))
    done = len(list(run.path("responses").glob("responses-*.jsonl"))) * run.data["shard_size"]
    tokens = max(prompts - done, 0) * run.data["max_new_tokens"]
    return tokens * run.probe() * DECODE_FACTOR


def _run_tokenize(run: RecipeRun) -> str:
    from ..data.tokenize import tokenize_responses

    summary = tokenize_responses(
        run.target()[1], run.path("responses"), run.path("tokenized"), max_length=run.data["max_length"],
        block_size=run.train_config["training"]["block_size"],
    )  # fmt: skip
    if not summary.get("kept"):
        raise ValueError(
            f"0 training samples in {run.path('tokenized')}: every reply had fewer than "
            f"{summary['min_supervised_tokens']} supervised tokens (2 x block_size); raise data.max_new_tokens or "
            "lower the block size (training.block_size), then run with --redo regenerate."
        )
    return f"{summary['kept']} samples, {summary['supervised_tokens']} supervised tokens"


def _run_pack(run: RecipeRun) -> str:
    from ..data.packed import pack_tokenized, recorded_settings

    tokenized = run.path("tokenized")
    settings = recorded_settings(tokenized, run.path("responses"), run.path("corpus"), "hf-dflash recipe")
    manifest = pack_tokenized(
        tokenized, run.path("packed"), part="recipe", settings=settings, tokenizer=run.target()[1],
        samples_per_shard=run.data["samples_per_shard"],
    )  # fmt: skip
    return f"{manifest['totals'].get('samples', 0)} samples in {len(manifest['shards'])} shard(s)"


def _tokens(run: RecipeRun) -> int:
    return read_json_object(run.path("tokenized") / "summary.json", "tokenized summary").get("tokens", 0)


def _run_features(run: RecipeRun) -> str:
    from ..data.feature_cache import cache_features
    from ..targets import resolve_dtype

    section = run.config["features"]
    layer_ids = run.train_config["drafter"].get("target_layer_ids")
    if layer_ids is None:  # drafter.init_from: the loaded drafter's layers are not known before it loads
        raise ValueError("features.enabled needs drafter.target_layer_ids in the recipe config with drafter.init_from.")
    top_k = teacher_top_k(run.config)
    cache_features(
        run.target()[0], run.path("tokenized"), run.path("features"), layer_ids, dtype=resolve_dtype(section["dtype"]),
        batch_size=section["batch_size"], target_name=run.config["target"], teacher_top_k=top_k,
    )  # fmt: skip
    return f"features of layers {layer_ids}" + (f" and the target's top-{top_k}" if top_k else "")


def teacher_top_k(config: dict) -> int:
    """features.teacher_top_k, or when null: 32 if training.loss_type distils (kl, ce+kl), else 0."""
    chosen = config["features"].get("teacher_top_k")
    if chosen is not None:
        return chosen
    return 0 if config["training"].get("loss_type", "ce") == "ce" else 32


def _features_settings(run: RecipeRun) -> dict:
    settings = {key: value for key, value in run.config["features"].items() if key != "teacher_top_k"}
    if top_k := teacher_top_k(
        run.config
    ):  # recorded only when cached: runs from before the teacher resume as they were
        settings["teacher_top_k"] = top_k
    return {**settings, "target_layer_ids": run.train_config["drafter"].get("target_layer_ids")}


def _run_train(run: RecipeRun) -> str:
    from ..trainer.train import train_from_config

    run.release()  # training loads the target itself, as `hf-dflash train` does
    trainer = train_from_config(run.train_config)
    steps = "already finished" if trainer is None else f"{trainer.state.global_step} steps"
    return f"drafter in {run.path('drafter')} ({steps})"


def _estimate_train(run: RecipeRun) -> float:
    training = run.train_config["training"]
    summary = read_json_object(run.path("tokenized") / "summary.json", "tokenized summary")
    samples, batch = max(summary.get("kept", 1), 1), training["per_device_train_batch_size"]
    steps = training.get("max_steps") or 0
    if steps <= 0:
        steps = training.get("num_train_epochs", 3) * -(-samples // batch)
    per_sample = summary.get("tokens", 0) / samples
    passes = 1 if training.get("feature_mode") == "offline" else 3  # + the target's forward when online
    return steps * batch * per_sample * run.probe() * passes


def _held_out_count(run: RecipeRun) -> int:
    return run.train_config["data"].get("eval_samples", 0)


def _run_heldout(run: RecipeRun) -> str:
    from ..checkpoints import load_drafter
    from ..trainer.heldout import held_out_samples, heldout_tau_row

    target = run.target()[0]
    drafter = load_drafter(str(run.path("drafter"))).to(target.dtype).eval()
    samples = held_out_samples(run.path("packed"), _held_out_count(run))
    row = heldout_tau_row(drafter, target, samples)
    settings = {
        "data": str(run.path("packed")),
        "held_out": f"the last {len(samples)} samples",
        "dtype": str(target.dtype),
    }
    write_json_atomic(run.path("heldout") / "heldout_tau.json", {"settings": settings, "result": row})
    return f"served-walk τ {row['served_tau']:.3f}, all-anchor τ {row['all_anchor_tau']:.3f} on {len(samples)} chats"


def _estimate_heldout(run: RecipeRun) -> float:
    summary = read_json_object(run.path("tokenized") / "summary.json", "tokenized summary")
    return _held_out_count(run) * summary.get("tokens", 0) / max(summary.get("kept", 1), 1) * run.probe() * 2


def _bench_sets(section: dict) -> list[str]:
    from ..bench import EVAL_SETS

    return section["sets"] if section["sets"] is not None else ([] if section["prompts"] else list(EVAL_SETS))


def _run_bench(run: RecipeRun) -> str:
    from ..bench import run_bench

    run.release()
    section = run.config["bench"]
    report = run_bench(
        run.config["target"], str(run.path("drafter")), sets=_bench_sets(section), prompts=section["prompts"],
        num_prompts=section["num_prompts"], max_new_tokens=section["max_new_tokens"], dtype=run.config["dtype"],
        seed=run.config["seed"], out=run.path("bench"), methods=section["methods"],
    )  # fmt: skip
    card = report.get("card") or {}
    overall = ", ".join(
        f"{name}: τ {row['tau']:.2f}, {row['speedup']:.2f}x" for name, row in card.get("sets", {}).items()
    )
    return overall or "no DFlash rows (add plain and dflash to bench.methods)"


def _estimate_bench(run: RecipeRun) -> float:
    section = run.config["bench"]
    prompts = section["num_prompts"] * max(len(_bench_sets(section)), 1)
    return prompts * len(section["methods"]) * section["max_new_tokens"] * run.probe() * DECODE_FACTOR


def _run_export(run: RecipeRun) -> str:
    from ..checkpoints import export_drafter
    from ..hub_cards.schemas import TRAINING_RECORD_NAME, load_training_record

    record = dict(load_training_record(run.path("drafter") / TRAINING_RECORD_NAME))
    record["derived_settings"] = {setting.name: setting.record() for setting in run.derived}
    benchmark = run.path("bench") / "benchmark.json"
    section = run.config["export"]
    export_drafter(
        str(run.path("drafter")), run.path("export"), run.config["target_id"],
        benchmark_json=benchmark if benchmark.is_file() else None, training_record=record,
        official=section["official"], license=section["license"], dtype=section["dtype"], repo_id=section["repo_id"],
        target=run.config["target"],  # an official copy of a pruned-vocabulary drafter holds its head rows (fp32)
    )  # fmt: skip
    return f"Hub repository folder {run.path('export')}"


def _section(name: str) -> Callable[[RecipeRun], dict]:
    return lambda run: dict(run.config[name])


STAGES: list[Stage] = [
    Stage("prompts", "corpus", "decontaminated prompt corpus",
          lambda run: {**_data_keys("sources", "prompts", "max_prompts")(run), "seed": run.config["seed"]}, _run_prompts),
    Stage("regenerate", "responses", "replies regenerated by the target", _regenerate_settings, _run_regenerate,
          _estimate_regenerate, resumable=True),
    Stage("tokenize", "tokenized", "tokenised chats, loss on replies",
          lambda run: {"max_length": run.data["max_length"], "block_size": run.train_config["training"]["block_size"]},
          _run_tokenize, resumable=True),
    Stage("pack", "packed", "packed shards with a manifest", _data_keys("samples_per_shard"), _run_pack),
    Stage("features", "features", "cached target features", _features_settings, _run_features,
          lambda run: _tokens(run) * run.probe(), resumable=True, enabled=lambda run: run.config["features"]["enabled"]),
    Stage("train", "drafter", "the drafter trained (hf-dflash train)", lambda run: run.train_config, _run_train,
          _estimate_train, resumable=True),
    Stage("heldout", "heldout", "held-out τ", lambda run: {**run.config["heldout"], "samples": _held_out_count(run)},
          _run_heldout, _estimate_heldout,
          enabled=lambda run: run.config["heldout"]["enabled"] and _held_out_count(run) > 0),
    Stage("bench", "bench", "benchmark (hf-dflash bench)", lambda run: {**_section("bench")(run), "dtype": run.config["dtype"]},
          _run_bench, _estimate_bench, enabled=lambda run: run.config["bench"]["enabled"]),
    Stage("export", "export", "Hub repository folder with card",
          lambda run: {**_section("export")(run), "target_id": run.config["target_id"]}, _run_export),
]  # fmt: skip
