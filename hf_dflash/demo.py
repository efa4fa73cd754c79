"""`hf-dflash demo`: a real target answers math, code and chat prompts with plain greedy and DFlash.

Until the trained SmolLM2 drafter ships in `models/`, the drafter is randomly initialised: outputs
stay identical to plain greedy (that is the point of speculative decoding), but a random drafter
is almost never right, so DFlash is slower than plain decoding here. The demo says so.
"""

import time

import torch
from transformers import TextStreamer

from .bench.divergence import divergence_note
from .modeling_dflash import DFlashConfig, DFlashDraftModel
from .models import DEFAULT_TARGET, load_target

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


def run_demo(max_new_tokens: int = 96, dtype: torch.dtype = torch.float32, block_size: int = 16) -> list[dict]:
    """Stream each demo answer through DFlash, then time plain vs DFlash side by side; print a summary."""
    target, tokenizer = load_target(DEFAULT_TARGET, dtype=dtype)
    torch.manual_seed(0)
    config = DFlashConfig.from_target_config(target.config, num_hidden_layers=3, block_size=block_size, tokenizer=tokenizer)
    drafter = DFlashDraftModel(config).to(dtype).eval()
    print(
        f"Target: {DEFAULT_TARGET} ({dtype}). Drafter: RANDOMLY INITIALISED (no trained drafter ships yet), "
        f"block size {block_size}.\nExpect identical outputs and τ ≈ 1: a random drafter makes DFlash slower, "
        "not faster. A trained drafter is what brings the speed-up.\n"
    )
    rows = []
    for name, text in DEMO_PROMPTS.items():
        inputs = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        print(f"=== {name}: {text}")
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        target.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, assistant_model=drafter, streamer=streamer)
        plain, plain_seconds = timed_generate(target, inputs, max_new_tokens=max_new_tokens)
        dflash, dflash_seconds = timed_generate(target, inputs, max_new_tokens=max_new_tokens, assistant_model=drafter)
        new_tokens = plain.shape[1] - inputs["input_ids"].shape[1]
        row = {
            "prompt": name,
            "new_tokens": new_tokens,
            "plain_tok_s": new_tokens / plain_seconds,
            "dflash_tok_s": (dflash.shape[1] - inputs["input_ids"].shape[1]) / dflash_seconds,
            "tau": drafter.last_acceptance.mean_acceptance_length,
            "identical": torch.equal(plain, dflash),
        }
        rows.append(row)
        verdict = "yes" if row["identical"] else "NO, " + divergence_note(target, plain, dflash, inputs["input_ids"].shape[1])
        print(
            f"--- plain {row['plain_tok_s']:.1f} tok/s | DFlash {row['dflash_tok_s']:.1f} tok/s | "
            f"τ {row['tau']:.2f} | identical to plain greedy: {verdict}\n"
        )
    return rows
