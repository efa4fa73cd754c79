"""`hf-dflash generate`: answer a JSONL of prompts in batches with DFlash (or plain decoding)."""

import json
import time
from pathlib import Path

import torch

from .data.corpus import read_prompts_file
from .data.regenerate import prompt_format, render_conversation
from .folder_lock import path_lock
from .generation.verifying.compiling import choose_compile, compiled_generate_kwargs, static_slots
from .json_files import write_atomic
from .output_paths import check_new_file


def generate_file(
    target,
    tokenizer,
    drafter,
    prompts_file: str | Path,
    out_file: str | Path,
    batch_size: int = 8,
    max_new_tokens: int = 256,
    overwrite: bool = False,
    compiled: bool = False,
) -> dict:
    """Write one `{"id", "messages", "response", "new_tokens"}` line per prompt to `out_file`.

    Prompts are sorted by length and left-padded in batches of `batch_size` (less padding); `drafter=None`
    decodes plainly; `compiled` runs each batch with a static cache and `torch.compile` (`compiled_generate_kwargs`;
    a graph's first call compiles it, inside the timed seconds). Returns throughput: new tokens summed over rows
    per second, and τ for DFlash.
    `out_file` must be new unless `overwrite`, and is never the prompts file; it is written atomically.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
    check_new_file(out_file, overwrite=overwrite, inputs={"--prompts": prompts_file})
    records = read_prompts_file(prompts_file, require_prompts=True)
    # as `bench` and the training data render them: a tokenizer without a chat template reads the running text
    texts = [render_conversation(tokenizer, r["messages"], add_generation_prompt=True) for r in records]
    order = sorted(range(len(records)), key=lambda i: len(texts[i]))
    tokenizer.padding_side = "left"
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    results, new_tokens, seconds, acceptance = {}, 0, 0.0, []
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        batch = tokenizer([texts[i] for i in rows], return_tensors="pt", padding=True, add_special_tokens=False)
        batch = batch.to(target.device)
        extra = {}
        if compiled:
            block_size = drafter.config.block_size if drafter is not None else 0
            slots = static_slots(batch["input_ids"].shape[1] + max_new_tokens, block_size)
            extra = compiled_generate_kwargs(target, slots, plain=drafter is None)
        begin = time.perf_counter()
        output = target.generate(
            **batch, do_sample=False, max_new_tokens=max_new_tokens, assistant_model=drafter, pad_token_id=pad_token_id,
            **extra,
        )  # fmt: skip
        seconds += time.perf_counter() - begin
        if drafter is not None:
            acceptance += drafter.last_acceptance.acceptance_lengths
        for row, index in enumerate(rows):
            generated = output[row, batch["input_ids"].shape[1] :]
            count = int((generated != pad_token_id).sum())  # finished rows are padded with pad_token_id
            new_tokens += count
            results[index] = {
                "id": records[index]["id"],
                "messages": records[index]["messages"],
                "response": tokenizer.decode(generated, skip_special_tokens=True),
                "new_tokens": count,
            }
    write_atomic(
        out_file, "".join(json.dumps(results[index], ensure_ascii=False) + "\n" for index in range(len(records)))
    )
    summary = {
        "prompts": len(records),
        "batch_size": batch_size,
        "new_tokens": new_tokens,
        "seconds": seconds,
        "tokens_per_second": new_tokens / seconds if seconds else 0.0,
        "mean_acceptance_length": sum(acceptance) / len(acceptance) if acceptance else None,
    }
    return summary


@torch.no_grad()
def run_generate(args) -> dict:
    """The CLI entry: load target and drafter (`--drafter random|PATH|none`) like `hf-dflash bench`."""
    from .bench.loading import RANDOM_DRAFTER, check_block_size_policy, load_bench_models
    from .generation.policies.block_size import parse_block_size_policy
    from .targets import resolve_device, shipped_drafter

    drafter_path = str(shipped_drafter(args.target)) if args.drafter is None else args.drafter
    read_prompts_file(args.prompts, require_prompts=True)  # a bad prompts file fails before any model loads
    check_new_file(args.out, overwrite=args.overwrite, inputs={"--prompts": args.prompts})  # and a bad --out
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}.")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}.")
    if drafter_path != "none":
        check_block_size_policy(args.block_size_policy, drafter_path)
    # One writer per --out file (its lock file beside it, which is also the write probe): a second run writing
    # the same file, or a folder that cannot be written, is refused before any model loads.
    with path_lock(args.out, "generate --out", kind="file"):
        device = resolve_device(None)  # where load_bench_models puts the models
        compiled, why = choose_compile(args.compile, device)
        models = load_bench_models(args.target, RANDOM_DRAFTER if drafter_path == "none" else drafter_path, args.dtype)
        drafter = None if drafter_path == "none" else models.drafter
        if drafter is not None:
            drafter.block_size_policy = parse_block_size_policy(args.block_size_policy, drafter.config.block_size)
        print(f"compile: {why}\nprompt format: {prompt_format(models.tokenizer)}")
        summary = generate_file(
            models.target, models.tokenizer, drafter, args.prompts, args.out, args.batch_size, args.max_new_tokens,
            overwrite=args.overwrite, compiled=compiled,
        )  # fmt: skip
        tau = summary["mean_acceptance_length"]
        print(
            f"{summary['prompts']} prompts, batch {args.batch_size}: {summary['new_tokens']} new tokens in "
            f"{summary['seconds']:.1f} s = {summary['tokens_per_second']:.1f} tok/s"
            + (f", τ {tau:.2f}" if tau is not None else " (plain decoding)")
            + f"; drafter: {models.drafter_description if drafter is not None else 'none'}; wrote {args.out}"
        )
        return summary
