"""The whole data preparation: corpus -> regenerated replies -> tokenised training shards, resumable.

    out/corpus/      prompts.jsonl, dropped.jsonl, summary.json   (build_corpus)
    out/responses/   responses-00000.jsonl, ...                    (regenerate_responses)
    out/tokenized/   tokenized-00000.jsonl, ..., summary.json      (tokenize_responses)

Every stage records its settings in `config.json` and skips the work already done, so rerunning
the same command after a kill continues where it stopped.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from ..folder_lock import folder_lock
from ..json_files import read_jsonl
from ..modeling_dflash import DFlashConfig
from ..output_paths import check_output_folder
from ..targets import DEFAULT_TARGET, load_target
from .corpus import build_corpus
from .regenerate import DEFAULT_REGENERATION_BATCH, DEFAULT_REGENERATION_SHARD, regenerate_responses
from .sources import DEFAULT_TRAIN_SOURCES
from .tokenize import tokenize_responses

__all__ = ["prepare_data", "prompt_token_limit"]


def check_prepare_settings(**settings) -> None:
    """Every setting of `prepare_data` checked before any stage runs (a bad one used to surface only after
    every reply was regenerated). Counts are integers >= 1 (`max_prompts`, `max_prompt_tokens`: or None)."""
    for name, value in settings.items():
        if name == "temperature":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {value!r}.")
        elif value is None and name in ("max_prompts", "max_prompt_tokens"):
            continue
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} (--{name.replace('_', '-')}) must be an integer >= 1, got {value!r}.")
    if settings["max_new_tokens"] >= settings["max_length"]:
        raise ValueError(
            f"max_new_tokens ({settings['max_new_tokens']}) must be smaller than max_length ({settings['max_length']})."
        )


def prompt_token_limit(max_prompt_tokens: int | None, max_length: int, max_new_tokens: int) -> int:
    """The longest rendered prompt regenerated: `max_prompt_tokens` (None: no cap of its own), and never more than
    `max_length` leaves for a `max_new_tokens` reply."""
    room = max_length - max_new_tokens
    return room if max_prompt_tokens is None else min(max_prompt_tokens, room)


def prepare_data(
    out_dir: str | Path,
    *,
    sources: Sequence[str] = DEFAULT_TRAIN_SOURCES,
    prompts_file: str | Path | None = None,
    max_prompts: int | None = None,
    target: str = DEFAULT_TARGET,
    dtype: torch.dtype | str = torch.bfloat16,
    temperature: float = 0.0,
    max_new_tokens: int = 512,
    batch_size: int = DEFAULT_REGENERATION_BATCH,
    shard_size: int = DEFAULT_REGENERATION_SHARD,
    max_length: int = 3072,
    max_prompt_tokens: int | None = None,
    block_size: int = DFlashConfig.block_size,
    seed: int = 0,
    progress: bool = True,
    eval_suite: dict[str, list[dict]] | None = None,
) -> dict:
    """Run (or resume) the three stages into `out_dir`; returns {"corpus": summary, "tokenized": summary}.

    Prompts longer than `max_prompt_tokens`, or leaving no room for `max_new_tokens` within `max_length`,
    are skipped (recorded with the reason).
    See `build_corpus`, `regenerate_responses` and `tokenize_responses` for the arguments.
    """
    check_prepare_settings(
        max_prompts=max_prompts, temperature=temperature, max_new_tokens=max_new_tokens, batch_size=batch_size,
        shard_size=shard_size, max_length=max_length, max_prompt_tokens=max_prompt_tokens, block_size=block_size,
    )  # fmt: skip
    out_dir = check_output_folder(out_dir, "out_dir (--out)")
    with folder_lock(out_dir, "prepare-data"):  # one run per output folder
        corpus = build_corpus(
            out_dir / "corpus",
            sources,
            prompts_file=prompts_file,
            max_prompts=max_prompts,
            seed=seed,
            eval_suite=eval_suite,
        )
        prompts = list(read_jsonl(out_dir / "corpus" / "prompts.jsonl"))
        model, tokenizer = load_target(target, dtype=dtype)
        regenerate_responses(
            model,
            tokenizer,
            prompts,
            out_dir / "responses",
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            shard_size=shard_size,
            max_prompt_tokens=prompt_token_limit(max_prompt_tokens, max_length, max_new_tokens),
            seed=seed,
            progress=progress,
        )
        tokenized = tokenize_responses(
            tokenizer, out_dir / "responses", out_dir / "tokenized", max_length=max_length, block_size=block_size
        )
        return {"corpus": corpus, "tokenized": tokenized}
