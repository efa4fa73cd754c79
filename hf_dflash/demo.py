"""`hf-dflash demo`: a real target answers math, code and chat prompts with plain greedy and DFlash.

The drafter is the one shipped in this repository (`models/smollm2-135m-instruct-dflash`, trained by
our own pipeline), or any drafter folder passed with `--drafter`.
"""

import time
from pathlib import Path

import torch
from transformers import TextStreamer

from .bench.divergence import first_divergence
from .checkpoints import load_drafter
from .dtypes import resolve_dtype
from .machine_load import timing_threads
from .targets import DEFAULT_TARGET, SHIPPED_DRAFTERS, load_target

# In half precision a k-token verification forward may round a near-tie between the target's top two
# tokens differently from a 1-token decode step. A first difference at a smaller top-2 logit gap is
# such a rounding flip; a larger one fails the demo (in float32 any difference does).
NEAR_TIE_LOGIT_GAP = 0.5

# The drafter that ships with the repository (a source checkout or an editable install).
SHIPPED_DRAFTER = SHIPPED_DRAFTERS[DEFAULT_TARGET]

DEMO_PROMPTS = {
    "math": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Please reason step by step, and put your "
    "final answer within \\boxed{}.",
    "code": "Write a Python function `is_prime(n)` that returns True when n is a prime number.",
    "chat": "Give me three tips for staying focused while working from home.",
}


def timed_generate(target, inputs, **kwargs) -> tuple[torch.LongTensor, float]:
    start = time.perf_counter()
    output = target.generate(**inputs, do_sample=False, **kwargs)
    return output, time.perf_counter() - start


def demo_succeeded(rows: list[dict]) -> bool:
    """Every answer equals plain greedy, or (half precision only) first differs at a near-tie."""
    return all(row["identical"] or row["near_tie"] for row in rows)


def run_demo(
    max_new_tokens: int = 128, dtype: torch.dtype | str = "auto", drafter_path: str | Path = SHIPPED_DRAFTER
) -> list[dict]:
    """Stream each demo answer through DFlash, then time plain vs DFlash side by side; print a summary.
    `dtype="auto"`: bfloat16 where the CPU multiplies bf16 natively, else float32 (`hf_dflash.dtypes`)."""
    dtype = resolve_dtype(dtype)
    if not Path(drafter_path).is_dir():
        raise ValueError(
            f"No drafter folder at {drafter_path}: run the demo from a checkout of the repository (it ships "
            "models/smollm2-135m-instruct-dflash) or pass --drafter FOLDER."
        )
    target, tokenizer = load_target(DEFAULT_TARGET, dtype=dtype)
    drafter = load_drafter(drafter_path).to(dtype).eval()
    drafter.block_size_policy = "adaptive"  # block length per round from acceptance and measured costs
    config = drafter.config
    print(
        f"Target: {DEFAULT_TARGET} ({dtype}). Drafter: {drafter_path} ({config.num_hidden_layers} layers, "
        f"block size {config.block_size}, adaptive block length).\n"
    )
    with timing_threads(target):  # the machine's load printed (a warning when shared), threads chosen
        return [
            _demo_row(target, tokenizer, drafter, name, text, max_new_tokens, dtype)
            for name, text in DEMO_PROMPTS.items()
        ]


def _demo_row(target, tokenizer, drafter, name: str, text: str, max_new_tokens: int, dtype: torch.dtype) -> dict:
    """Stream one demo answer through DFlash, then time plain vs DFlash on it; prints and returns its row."""
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    print(f"=== {name}: {text}")
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    target.generate(
        **inputs, do_sample=False, max_new_tokens=max_new_tokens, assistant_model=drafter, streamer=streamer
    )
    plain, plain_seconds = timed_generate(target, inputs, max_new_tokens=max_new_tokens)
    dflash, dflash_seconds = timed_generate(target, inputs, max_new_tokens=max_new_tokens, assistant_model=drafter)
    new_tokens = plain.shape[1] - inputs["input_ids"].shape[1]
    row = {
        "prompt": name,
        "new_tokens": new_tokens,
        "plain_tok_s": new_tokens / plain_seconds,
        "dflash_tok_s": (dflash.shape[1] - inputs["input_ids"].shape[1]) / dflash_seconds,
        "tau": drafter.last_acceptance.mean_acceptance_length,
        "mean_block": sum(drafter.last_acceptance.block_sizes) / max(len(drafter.last_acceptance.block_sizes), 1),
        "identical": torch.equal(plain, dflash),
    }
    divergence = first_divergence(target, plain, dflash, inputs["input_ids"].shape[1])
    row["near_tie"] = divergence is not None and dtype != torch.float32 and divergence.logit_gap <= NEAR_TIE_LOGIT_GAP
    verdict = "yes" if divergence is None else "NO, " + divergence.note()
    if row["near_tie"]:
        verdict += f" (a {str(dtype).removeprefix('torch.')} rounding flip at a near-tie: fp32 is token-exact)"
    print(
        f"--- plain {row['plain_tok_s']:.1f} tok/s | DFlash {row['dflash_tok_s']:.1f} tok/s | "
        f"τ {row['tau']:.2f} | mean block {row['mean_block']:.1f} | identical to plain greedy: {verdict}\n"
    )
    return row
