"""Tokenise regenerated conversations into `{"id", "input_ids", "loss_mask"}` training samples.

`loss_mask` is 1 exactly on the tokens of assistant replies (their text and the end-of-turn token that
closes them), 0 on system/user turns and template glue. The assistant spans are found by rendering
the chat template incrementally: the text of reply i starts where `render(messages[:i],
add_generation_prompt=True)` ends, so this works with any template whose rendering of a conversation
extends the rendering of its prefixes (templates without `{% generation %}` markers included). A base
model without a chat template reads the conversation as plain running text (`render_conversation`):
its replies are the continuations, supervised the same way.

Reads the `responses-*.jsonl` shards of `regenerate_responses` and writes one `tokenized-*.jsonl` shard per
response shard, plus `summary.json` (counts, also the record of finished shards: a restart skips them).
Samples with fewer than `2 * block_size` supervised tokens (after truncation to `max_length`) are dropped.
"""

from __future__ import annotations

import hashlib
import json
from bisect import bisect_left, bisect_right
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from ..json_files import read_jsonl, write_atomic
from ..modeling_dflash import DFlashConfig
from .regenerate import SHARD_PREFIX as RESPONSES_PREFIX
from .regenerate import render_conversation
from .shards import check_stage_config, write_jsonl_atomic

__all__ = [
    "SHARD_PREFIX",
    "assistant_char_spans",
    "chat_template_sha256",
    "tokenize_conversation",
    "tokenize_responses",
]

SHARD_PREFIX = "tokenized"
SUMMARY_FILE = "summary.json"


def render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return render_conversation(tokenizer, messages, add_generation_prompt=add_generation_prompt)


def assistant_char_spans(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(rendered conversation, [(start, end) character span of each assistant reply's text]).

    Raises:
        ValueError: the template renders a conversation differently from its prefixes, or rewrites a
            reply, so reply positions cannot be read off the prefixes.
    """
    text = render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], add_generation_prompt=True)
        after = render(tokenizer, messages[: i + 1])
        if not (after.startswith(before) and text.startswith(after)):
            raise ValueError(
                f"The chat template does not render message {i} as an extension of the conversation before it "
                "(it rewrites earlier turns); assistant tokens cannot be located by prefix rendering."
            )
        content = message["content"]
        offset = after.find(content, len(before)) if content else len(before)
        if offset < 0:
            content = content.strip()
            offset = after.find(content, len(before))
        if offset < 0:
            raise ValueError(f"The chat template rewrites the text of assistant message {i}; cannot locate it.")
        spans.append((offset, offset + len(content)))
    return text, spans


def tokenize_conversation(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a conversation rendered with the chat template.

    A token is supervised when it overlaps an assistant reply's text, or when it is the end-of-turn
    token (the tokenizer's EOS) right after a reply: the target generates it, so the drafter must too.
    """
    text, spans = assistant_char_spans(tokenizer, messages)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = encoding["input_ids"]
    starts = [start for start, _ in encoding["offset_mapping"]]  # non-decreasing
    ends = [end for _, end in encoding["offset_mapping"]]  # non-decreasing
    loss_mask = [0] * len(input_ids)
    for span_start, span_end in spans:
        first, stop = bisect_right(ends, span_start), bisect_left(starts, span_end)  # tokens overlapping the span
        loss_mask[first:stop] = [1] * max(stop - first, 0)
        if stop < len(input_ids) and input_ids[stop] == tokenizer.eos_token_id:
            loss_mask[stop] = 1
    return input_ids, loss_mask


def chat_template_sha256(tokenizer: PreTrainedTokenizerBase) -> str:
    """Hex SHA-256 of the tokenizer's chat template (recorded with tokenised and packed data)."""
    return hashlib.sha256(str(tokenizer.chat_template).encode()).hexdigest()


def tokenize_responses(
    tokenizer: PreTrainedTokenizerBase,
    responses_dir: str | Path,
    out_dir: str | Path,
    *,
    max_length: int = 3072,
    block_size: int = DFlashConfig.block_size,
) -> dict:
    """Tokenise every response shard in `responses_dir` into `out_dir`; returns the summary.

    Raises:
        ValueError: bad settings, or `out_dir` holds shards made with other settings.
    """
    if max_length < 1 or block_size < 1:
        raise ValueError(f"max_length and block_size must be positive, got {max_length} and {block_size}.")
    responses_dir, out_dir = Path(responses_dir), Path(out_dir)
    check_stage_config(
        out_dir,
        {
            "tokenizer": Path(tokenizer.name_or_path).name,
            "chat_template_sha256": chat_template_sha256(tokenizer),
            "vocab_size": len(tokenizer),
            "max_length": max_length,
            "block_size": block_size,
        },
    )
    summary_path = out_dir / SUMMARY_FILE
    shards = json.loads(summary_path.read_text(encoding="utf-8"))["shards"] if summary_path.is_file() else {}
    min_supervised = 2 * block_size
    for source in sorted(responses_dir.glob(f"{RESPONSES_PREFIX}-*.jsonl")):
        name = source.name.replace(RESPONSES_PREFIX, SHARD_PREFIX, 1)
        if name in shards and (out_dir / name).is_file():
            continue
        counts = {
            "conversations": 0,
            "kept": 0,
            "skipped_prompts": 0,
            "too_few_supervised": 0,
            "truncated": 0,
            "tokens": 0,
            "supervised_tokens": 0,
        }
        samples = []
        for row in read_jsonl(source):
            counts["conversations"] += 1
            if "skipped" in row:
                counts["skipped_prompts"] += 1
                continue
            input_ids, loss_mask = tokenize_conversation(tokenizer, row["messages"])
            if len(input_ids) > max_length:
                counts["truncated"] += 1
                input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
            if sum(loss_mask) < min_supervised:
                counts["too_few_supervised"] += 1
                continue
            counts["kept"] += 1
            counts["tokens"] += len(input_ids)
            counts["supervised_tokens"] += sum(loss_mask)
            samples.append({"id": row["id"], "input_ids": input_ids, "loss_mask": loss_mask})
        write_jsonl_atomic(out_dir / name, samples)
        shards[name] = counts
        write_atomic(summary_path, json.dumps(summarize(shards, min_supervised), indent=2) + "\n")
    summary = summarize(shards, min_supervised)
    write_atomic(summary_path, json.dumps(summary, indent=2) + "\n")
    return summary


def summarize(shards: dict[str, dict], min_supervised: int) -> dict:
    """Totals over the shards, plus the per-shard counts (kept in order of shard name)."""
    keys = next(iter(shards.values())).keys() if shards else ()
    totals = {key: sum(counts[key] for counts in shards.values()) for key in keys}
    return {"min_supervised_tokens": min_supervised, **totals, "shards": dict(sorted(shards.items()))}
