"""The recipe's settings and every stage's inputs, checked before the first stage runs: a bad value used to
surface only in its own stage, after regeneration and training had run (minutes to hours of CPU).

`check_recipe_settings(config)` reads nothing heavy (the prompt files and the benchmark's sets);
`check_drafter_for_target(train_config, target_config)` builds the drafter's config from the target's config
(no weights), as training will, so a layer id past the target, a draft vocabulary larger than the target's or a
block size policy longer than the block is refused by the config's own checks. Each message names the key.
"""

from __future__ import annotations

from ..trainer.config_schema import MAX_SEED

__all__ = ["check_drafter_for_target", "check_recipe_settings"]


def _count(where: str, value, lowest: int, meaning: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise ValueError(f"{where}: must be an integer >= {lowest}{meaning}, got {value!r}.")


def _named(key: str, check, *args):
    """`check(*args)`; its ValueError is prefixed with the recipe key it concerns."""
    try:
        return check(*args)
    except ValueError as error:
        raise ValueError(f"{key}: {error}") from None


def check_recipe_settings(config: dict) -> None:
    """Ranges the type checks let through, and the input files of the prompts and bench stages."""
    from ..bench.prompts import select_prompt_sets
    from ..data.corpus import check_prompts_file
    from ..data.sources import TRAIN_SOURCES
    from .stages import _bench_sets

    seed = config["seed"]
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed: must be an integer in [0, {MAX_SEED}], got {seed!r}.")
    data = config["data"]
    _count("data.samples_per_shard", data["samples_per_shard"], 1)
    _count("data.eval_samples", data["eval_samples"], 0, " (0: no held-out chats)")
    unknown = [name for name in data["sources"] or [] if name not in TRAIN_SOURCES]
    if unknown:
        raise ValueError(f"data.sources: unknown {unknown}; choose from {', '.join(TRAIN_SOURCES)}.")
    if data["prompts"] is not None:
        _named("data.prompts", check_prompts_file, data["prompts"])
    elif not data["sources"]:
        raise ValueError("data.sources is empty and data.prompts is null: give sources and/or a prompts file.")
    if config["features"]["enabled"]:
        _count("features.batch_size", config["features"]["batch_size"], 1)
        top_k, loss_type = config["features"]["teacher_top_k"], config["training"].get("loss_type", "ce")
        if top_k is not None:
            _count("features.teacher_top_k", top_k, 0, " (0: features only; null: 32 when distilling)")
        if top_k == 0 and loss_type != "ce":
            raise ValueError(
                f"features.teacher_top_k: 0 caches no teacher, but training.loss_type={loss_type!r} distils the "
                "target's distribution; set it > 0 (or null: 32)."
            )
    bench = config["bench"]
    if bench["enabled"]:
        _count("bench.num_prompts", bench["num_prompts"], 0, " (0: every prompt)")
        _count("bench.max_new_tokens", bench["max_new_tokens"], 1)
        key = "bench.prompts" if bench["prompts"] is not None else "bench.sets"
        _named(key, select_prompt_sets, _bench_sets(bench), bench["prompts"], bench["num_prompts"], seed)


def check_drafter_for_target(train_config: dict, target_config) -> None:
    """The training stage's drafter against the target: `drafter.init_from` is a drafter folder (or Hub id) with
    readable weights, or the drafter's config derived from `target_config` passes `DFlashConfig`'s checks."""
    from ..modeling_dflash import DFlashConfig

    drafter = dict(train_config["drafter"] or {})
    block_size = train_config["training"]["block_size"]
    if (init_from := drafter.get("init_from")) is not None:
        from ..checkpoints.files import check_weight_files, resolve_folder
        from ..checkpoints.loading import detect_format

        def readable(path):
            folder = resolve_folder(path)
            detect_format(folder)
            check_weight_files(folder)

        try:
            readable(init_from)
        except (ValueError, OSError) as error:
            raise ValueError(f"drafter.init_from: {error} Set it to a drafter folder, or remove it.") from None
        return
    drafter.pop("init_from_target", None)
    drafter.setdefault("block_size", block_size)
    _named(
        "recipe config (drafter and training sections)",
        lambda: DFlashConfig.from_target_config(target_config, **drafter),
    )
