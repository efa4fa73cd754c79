"""The benchmark loop: every method on the same prompts, interleaved per prompt, method order rotated.

Running all methods back to back on each prompt (rather than one method over all prompts, then the
next) exposes them to the same machine state; rotating which method goes first cancels the residual
advantage of going first or last (warm caches, thermal state, other jobs on a shared machine).

Multi-turn records (MT-Bench): each user turn is generated after the model's own reply to the turn
before. Every method continues from the same reply, the reference method's (plain decoding when it
runs), so all methods always see identical prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from ..data.regenerate import render_conversation
from .divergence import Divergence, first_divergence
from .methods import COMPILED_METHODS, METHODS, Generation, check_methods, generate_with, static_cache_slots

__all__ = ["Sample", "chat_inputs", "compare_turn", "generation_settings", "rotated", "run_benchmark"]

WARMUP_TOKENS = 4


@dataclass
class Sample:
    """One method's answer to one turn of one prompt."""

    set: str
    prompt_id: str
    turn: int  # 0-based user turn of the conversation
    method: str
    prompt_tokens: int
    new_tokens: int
    seconds: float
    acceptance_lengths: list[int] | None  # per verification round; None for plain decoding
    block_sizes: list[int] | None  # our DFlash loop: block length k of every round (policy's choice)
    identical: bool | None  # equals plain greedy; None for plain itself and when sampling
    divergence: Divergence | None  # where it first differs from plain greedy (when not identical)
    branches: dict[str, int] | None = None  # hybrid: committed tokens by origin (see `Generation`)
    round_costs: list[list[float]] | None = None  # hybrid: [tree nodes, target forward seconds] per round
    compiles: int | None = None  # compiled methods: graphs compiled while timed (warm-up did not settle); eager: None


def rotated(methods: Sequence[str], index: int) -> list[str]:
    """`methods` rotated left by `index`: prompt i starts with method i mod len(methods)."""
    shift = index % len(methods)
    return list(methods[shift:]) + list(methods[:shift])


def chat_inputs(tokenizer, messages: list[dict], device: torch.device) -> dict[str, torch.Tensor]:
    """The prompt as `generate` inputs of batch size 1: chat-templated with the assistant header, or, for a base
    model without a chat template, the running text the training data renders (`render_conversation`: BOS, then
    the messages back to back), so the answer is its continuation."""
    text = render_conversation(tokenizer, messages, add_generation_prompt=True)
    inputs = tokenizer(text, add_special_tokens=False, return_tensors="pt")
    return {key: value.to(device) for key, value in inputs.items()}


def generation_settings(tokenizer, max_new_tokens: int, temperature: float) -> dict:
    """`generate` keyword arguments shared by every method: greedy, or sampling at `temperature`."""
    sampling = temperature > 0
    return {
        "max_new_tokens": max_new_tokens,
        "do_sample": sampling,
        "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        **({"temperature": temperature} if sampling else {}),
    }


def compare_turn(
    target, generations: dict[str, Generation], prompt_length: int, compare: bool, **where
) -> list[Sample]:
    """One `Sample` per method of one turn; with `compare`, each checked token for token against plain."""
    samples = []
    for method, generation in generations.items():
        checked = compare and method not in ("plain", "plain-alt")  # plain-alt runs in another dtype
        divergence = None
        if checked:
            divergence = first_divergence(target, generations["plain"].sequences, generation.sequences, prompt_length)
        samples.append(
            Sample(
                **where,
                method=method,
                prompt_tokens=prompt_length,
                new_tokens=generation.sequences.shape[1] - prompt_length,
                seconds=generation.seconds,
                acceptance_lengths=generation.acceptance_lengths,
                block_sizes=generation.block_sizes,
                identical=(divergence is None) if checked else None,
                divergence=divergence,
                branches=generation.branches,
                round_costs=generation.round_costs,
                compiles=generation.compiles,
            )
        )
    return samples


def warm_up(methods, slots: dict, compiled_lengths: dict, first: bool, warmup_seconds: dict | None, run) -> None:
    """Untimed warm-up calls (`run(method)` returns its seconds, added to `warmup_seconds`): every method before
    its first prompt (allocations, kernel selection), and a compiled method at each new static cache length
    (`slots`: its length for this prompt; `compiled_lengths`: those compiled so far), which compiles a graph."""
    for method in methods:
        compiled = compiled_lengths.setdefault(method, set())
        if not first and (method not in slots or slots[method] in compiled):
            continue
        seconds = run(method)
        compiled.add(slots.get(method))
        if warmup_seconds is not None:
            warmup_seconds[method] = warmup_seconds.get(method, 0.0) + seconds


def run_benchmark(
    target,
    tokenizer,
    drafter,
    prompt_sets: dict[str, list[dict]],
    methods: Sequence[str] = METHODS,
    *,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    seed: int = 0,
    progress: bool = True,
    alt_target=None,
    warmup_seconds: dict[str, float] | None = None,
) -> list[Sample]:
    """Generate every turn of every prompt with every method; return one `Sample` per answer.

    Greedy (`temperature` 0): each answer is compared token for token with plain greedy, and the first
    difference is located with the target's top-2 logit gap there. Sampling: every method of a prompt
    starts from the same seed (`seed` + prompt index); outputs legitimately differ and are not compared.
    `alt_target` (the same target in another dtype) runs the "plain-alt" method. `warmup_seconds`, when
    given, receives each method's untimed warm-up calls in seconds: one per method, and for the compiled
    methods one more per new static cache length (each length compiles a graph).
    """
    check_methods(methods)
    if "plain-alt" in methods and alt_target is None:
        raise ValueError("Method 'plain-alt' needs alt_target: the same target loaded in the other dtype.")

    def model_for(method: str):
        return alt_target if method == "plain-alt" else target

    settings = generation_settings(tokenizer, max_new_tokens, temperature)
    reference = "plain" if "plain" in methods else methods[0]  # whose reply the next turn follows
    compare = temperature <= 0 and "plain" in methods
    samples: list[Sample] = []
    warm = False
    compiled_lengths: dict[str, set] = {}  # per method: the static cache lengths already compiled
    bar = tqdm(total=sum(map(len, prompt_sets.values())), desc="bench", unit="prompt", disable=not progress)
    index = 0  # prompt counter over all sets: rotation and sampling seed
    for set_name, records in prompt_sets.items():
        bar.set_postfix_str(set_name)
        for record in records:
            history: list[dict] = []
            for message in record["messages"]:
                history.append(message)
                if message["role"] != "user":  # a leading system message
                    continue
                inputs = chat_inputs(tokenizer, history, target.device)
                prompt_length = inputs["input_ids"].shape[1]
                slots = {
                    method: static_cache_slots(method, drafter, prompt_length, max_new_tokens)
                    for method in methods
                    if method in COMPILED_METHODS
                }
                warm_up(
                    methods, slots, compiled_lengths, not warm, warmup_seconds,
                    lambda method, inputs=inputs, slots=slots: generate_with(
                        method, model_for(method), drafter, inputs, {**settings, "max_new_tokens": WARMUP_TOKENS},
                        slots=slots.get(method),
                    ).seconds,
                )  # fmt: skip
                warm = True
                generations = {}
                for method in rotated(methods, index):
                    torch.manual_seed(seed + index)
                    generations[method] = generate_with(
                        method, model_for(method), drafter, inputs, settings, slots=slots.get(method)
                    )
                generations = {method: generations[method] for method in methods}  # report in the requested order
                turn = sum(message["role"] == "user" for message in history) - 1
                samples += compare_turn(
                    target, generations, prompt_length, compare, set=set_name, prompt_id=record["id"], turn=turn
                )
                reply = generations[reference].sequences[0, prompt_length:]
                history.append({"role": "assistant", "content": tokenizer.decode(reply, skip_special_tokens=True)})
            index += 1
            bar.update(1)
    bar.close()
    return samples
