"""Regenerate every reply with the target itself (the drafter must learn the target's own outputs).

Prompts are rendered with the target's chat template (a base model without one reads the plain text
and its reply is the continuation: `render_conversation`) and generated in left-padded batches; a
multi-turn prompt gets one reply per user turn, each generated after the earlier replies. Output
goes to resumable shards `responses-00000.jsonl`, ... of `shard_size` prompts: a shard is written in
one go (temporary file, then rename) once all its prompts are done, so a killed run loses at most the
shard in progress, and a restart skips the finished shards. Sampling is seeded per shard, so a
resumed run writes exactly what an uninterrupted one would.

Each output row: `{"id", "source", "messages": [..., {"role": "assistant", "content": reply}, ...],
"num_new_tokens": [per reply], "finished": [per reply: ended with EOS rather than max_new_tokens]}`,
or `{"id", "source", "skipped": reason}` when a prompt is longer than `max_prompt_tokens`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..folder_lock import folder_lock
from ..interrupts import raise_if_interrupted
from .continuous import continuous_batching_supported, continuous_greedy_replies
from .shards import check_stage_config, shard_name, write_jsonl_atomic

__all__ = [
    "SHARD_PREFIX",
    "generate_replies",
    "regenerate_responses",
    "render_conversation",
    "shard_seed",
    "user_turns",
]

SHARD_PREFIX = "responses"
# Rows per continuous batch and prompts per shard. Measured on 2 CPU cores (SmolLM2-135M, bf16, 1 torch
# thread, `benchmarks/data/regeneration_speed.py --methods continuous --batch-sizes 32,64,96`): 180 / 190 /
# 172 reply tok/s; a shard holds a few batches so that rows can keep joining.
DEFAULT_REGENERATION_BATCH = 64
DEFAULT_REGENERATION_SHARD = 256


def user_turns(messages: list[dict]) -> list[list[dict]]:
    """Split prompt messages into rounds, each ending with a user message: [[system?, user1], [user2], ...].
    Assistant messages are dropped (they are regenerated)."""
    rounds, current = [], []
    for message in messages:
        if message["role"] == "assistant":
            continue
        current.append(message)
        if message["role"] == "user":
            rounds.append(current)
            current = []
    return rounds


def render_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool = False
) -> str:
    """The text the target reads for `messages`: its chat template's rendering, or, for a base model whose
    tokenizer has no chat template, the plain running text: the BOS token, then every message's content
    back to back, so a reply is the continuation of the text before it (`add_generation_prompt` adds
    nothing then). Either way a conversation renders as an extension of its prefixes."""
    if not tokenizer.chat_template:
        return (tokenizer.bos_token or "") + "".join(message["content"] for message in messages)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def prompt_format(tokenizer: PreTrainedTokenizerBase) -> str:
    """Which rendering `render_conversation` applies to `tokenizer` (printed by `generate` and `bench`)."""
    if not tokenizer.chat_template:
        return (
            "no chat template in the tokenizer: the running text (BOS, then each message's content back to back), "
            "as the training data renders it"
        )
    return "the tokenizer's chat template, with the assistant header"


def shard_seed(seed: int, index: int) -> int:
    """The RNG seed of shard `index`: a restarted shard samples exactly as the first attempt did."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:8], "little")


def stop_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids that end a reply: the generation config's EOS ids, else the tokenizer's."""
    eos = model.generation_config.eos_token_id
    eos = tokenizer.eos_token_id if eos is None else eos
    if eos is None:
        raise ValueError("Neither the target's generation_config nor the tokenizer defines an eos_token_id.")
    return [eos] if isinstance(eos, int) else list(eos)


@torch.no_grad()
def generate_replies(
    model: PreTrainedModel,
    prompt_ids: list[list[int]],
    *,
    eos_ids: list[int],
    pad_id: int,
    temperature: float,
    max_new_tokens: int,
) -> list[list[int]]:
    """Generate one reply per prompt in a single left-padded batch; returns each reply's token ids,
    cut after its first EOS (kept) or at `max_new_tokens`."""
    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in prompt_ids], device=model.device)  # (B, T)
    attention_mask = torch.tensor(
        [[0] * (width - len(ids)) + [1] * len(ids) for ids in prompt_ids], device=model.device
    )  # (B, T)
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )
    output = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
        **sampling,
    )  # (B, T + new)
    replies = []
    for row in output[:, width:].tolist():
        end = next((position + 1 for position, token in enumerate(row) if token in eos_ids), len(row))
        replies.append(row[:end])
    return replies


def regenerate_shard(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[dict],
    *,
    temperature: float,
    max_new_tokens: int,
    batch_size: int,
    max_prompt_tokens: int,
    on_replies: Callable[[int], None],
) -> list[dict]:
    """Output rows for `prompts`, in their order (batches are formed longest prompt first)."""
    eos_ids = stop_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    rounds = [user_turns(prompt["messages"]) for prompt in prompts]
    rows = [
        {"id": prompt["id"], "source": prompt["source"], "messages": [], "num_new_tokens": [], "finished": []}
        for prompt in prompts
    ]
    for turn in range(max(map(len, rounds), default=0)):
        pending = []
        for i, row in enumerate(rows):
            if turn >= len(rounds[i]) or "skipped" in row:
                continue
            row["messages"].extend(rounds[i][turn])
            text = render_conversation(tokenizer, row["messages"], add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) > max_prompt_tokens:
                rows[i] = {
                    "id": row["id"],
                    "source": row["source"],
                    "skipped": f"prompt of {len(ids)} tokens > max_prompt_tokens={max_prompt_tokens}",
                }
                on_replies(len(rounds[i]) - turn)
            else:
                pending.append((i, ids))
        pending.sort(key=lambda item: -len(item[1]))  # similar lengths share a batch; the longest run first
        # Greedy: rows leave as they finish and new prompts join (see continuous.py), so one call takes every
        # pending prompt; otherwise left-padded batches of `batch_size`.
        continuous = temperature == 0 and continuous_batching_supported(model)
        batches = [pending] if continuous else [pending[s : s + batch_size] for s in range(0, len(pending), batch_size)]
        common = {"eos_ids": eos_ids, "pad_id": pad_id, "max_new_tokens": max_new_tokens}
        for batch in batches:
            prompt_ids = [ids for _, ids in batch]
            if continuous:
                replies = continuous_greedy_replies(
                    model, prompt_ids, batch_size=batch_size, on_reply=on_replies, **common
                )
            else:
                replies = generate_replies(model, prompt_ids, temperature=temperature, **common)
            record_replies(tokenizer, rows, [i for i, _ in batch], replies, eos_ids)
            if not continuous:
                on_replies(len(batch))  # continuous batching reports each reply as it ends
    return rows


def record_replies(tokenizer, rows: list[dict], indices: list[int], replies: list[list[int]], eos_ids: list[int]):
    """Append each reply (decoded) to its row's messages, with its length and whether it ended with EOS."""
    for i, reply in zip(indices, replies):
        rows[i]["messages"].append({"role": "assistant", "content": tokenizer.decode(reply, skip_special_tokens=True)})
        rows[i]["num_new_tokens"].append(len(reply))
        rows[i]["finished"].append(bool(reply) and reply[-1] in eos_ids)


def check_regeneration_settings(temperature: float, **counts: int) -> None:
    """ValueError naming a count below 1 or a negative temperature."""
    for name, value in counts.items():
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value}.")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}.")


def regenerate_responses(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[dict],
    out_dir: str | Path,
    *,
    temperature: float = 0.0,
    max_new_tokens: int = 512,
    batch_size: int = DEFAULT_REGENERATION_BATCH,
    shard_size: int = DEFAULT_REGENERATION_SHARD,
    max_prompt_tokens: int = 2048,
    seed: int = 0,
    progress: bool = True,
) -> list[Path]:
    """Write (or finish writing) the response shards of `prompts` into `out_dir`; returns their paths.

    Args:
        prompts: records `{"id", "source", "messages"}` (as built by `build_corpus`).
        temperature: 0 for greedy decoding; > 0 samples from the target's distribution at that
            temperature (no top-k/top-p truncation), seeded by `seed` and the shard index.
        max_new_tokens: reply length limit, per user turn.
        batch_size: prompts per `generate` call.
        shard_size: prompts per output shard (the work a kill can lose).
        max_prompt_tokens: longer rendered prompts are skipped (recorded with the reason).

    Raises:
        ValueError: a bad setting, or `out_dir` holds shards made with other settings or prompts, or
            another process is writing to it (`folder_lock`).
    """
    settings = {"max_new_tokens": max_new_tokens, "batch_size": batch_size, "shard_size": shard_size}
    check_regeneration_settings(temperature, max_prompt_tokens=max_prompt_tokens, **settings)
    out_dir = Path(out_dir)
    fingerprint = hashlib.sha256(json.dumps(prompts, sort_keys=True).encode()).hexdigest()
    with folder_lock(out_dir, "regeneration"):  # one writer per responses folder
        check_stage_config(
            out_dir,
            {
                "target": Path(model.config.name_or_path).name,  # the folder name: same target, any cache location
                "dtype": str(model.dtype),
                "prompts_sha256": fingerprint,
                "num_prompts": len(prompts),
                "temperature": temperature,
                **settings,
                "max_prompt_tokens": max_prompt_tokens,
                "seed": seed,
            },
        )
        shards = [prompts[start : start + shard_size] for start in range(0, len(prompts), shard_size)]
        paths = [out_dir / shard_name(SHARD_PREFIX, index) for index in range(len(shards))]
        done = sum(
            len(user_turns(prompt["messages"]))
            for shard, path in zip(shards, paths)
            if path.exists()
            for prompt in shard
        )
        total = sum(len(user_turns(prompt["messages"])) for prompt in prompts)
        with tqdm(total=total, initial=done, desc="regenerate", unit="reply", disable=not progress) as bar:
            for index, (shard, path) in enumerate(zip(shards, paths)):
                if path.exists():
                    continue
                torch.manual_seed(shard_seed(seed, index))
                rows = regenerate_shard(
                    model,
                    tokenizer,
                    shard,
                    temperature=temperature,
                    max_new_tokens=max_new_tokens,
                    batch_size=batch_size,
                    max_prompt_tokens=max_prompt_tokens,
                    on_replies=bar.update,
                )
                write_jsonl_atomic(path, rows)
                raise_if_interrupted(f"after {path.name}")  # a swallowed Ctrl-C stops here: the next run resumes
    return paths
