"""Regenerate a range of corpus prompts on CPU in the background, then pack it into the committed data.

How the committed `data/smollm2-135m-instruct` parts were made, as one resumable command per range:

    # regenerate (kill and re-run at will: finished shards are kept), one torch thread per job
    OMP_WAIT_POLICY=PASSIVE nice -n 19 python scripts/regenerate_range.py --part regen-bf16-part5 \\
        --start 7808 --end 13568 &
    # before the session ends: tokenize the finished shards and append them to the data (incremental)
    python scripts/regenerate_range.py --part regen-bf16-part5 --start 7808 --end 13568 --pack

`--target` picks the target (default SmolLM2-135M-Instruct); another target's parts go to their own
folders (work: out/regen-TARGET/PART, data: data/TARGET). A target without a chat template (Gemma 3
270M, a base model) continues each prompt as plain text, in static left-padded batches where its
sliding-window attention rules out continuous batching:

    OMP_WAIT_POLICY=PASSIVE nice -n 19 python scripts/regenerate_range.py --target gemma3-270m \
        --part regen-bf16-part0 --start 0 --max-new-tokens 256 --dtype bfloat16 &

`--prompts` is the decontaminated corpus the parts come from (`prompts.jsonl` of `hf-dflash
prepare-data`; default: the head start in ../shared/data). A part is one range with one set of settings:
a range that continues another on a fresh machine is a new part (pack-data refuses a sample id twice).
`--sources codeio,leetcode,sharegpt` keeps only the range's prompts of those sources, for a part aimed
at what a drafter lacks (pass the same `--sources` to `--pack`: the note records them).
data/README.md says which prompt ranges the parts hold.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from hf_dflash.data.regenerate import DEFAULT_REGENERATION_BATCH, DEFAULT_REGENERATION_SHARD
from hf_dflash.targets import DEFAULT_TARGET, KNOWN_TARGETS
from hf_dflash.user_errors import run_reporting_errors

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PROMPTS = REPO.parent / "shared" / "data" / "smollm2-regen-fp32-part0" / "corpus" / "prompts.jsonl"
DATA = REPO / "data"


def prompt_range(count: int, start: int, end: int | None) -> tuple[int, int]:
    """[start, end) of a corpus of `count` prompts (end None: the corpus end). Python's slice rules would
    read a negative start from the end and clamp an end past the corpus: both are errors here."""
    if start < 0 or start >= count:
        raise ValueError(f"--start {start}: must be a prompt index in [0, {count}) (the corpus holds {count} prompts).")
    end = count if end is None else end
    if not start < end <= count:
        raise ValueError(
            f"--end {end}: must be in ({start}, {count}] (one past the last prompt; the corpus holds {count})."
        )
    return start, end


def select_prompts(corpus: list[dict], start: int, end: int, sources: list[str] | None) -> list[dict]:
    """The corpus prompts in [start, end), only those whose `source` is in `sources` when given (corpus order
    kept: a part aimed at what a drafter lacks, e.g. code and chat, stays one reproducible span)."""
    prompts = corpus[start:end]
    if sources is None:
        return prompts
    held = sorted({prompt.get("source") for prompt in prompts} - {None})
    unknown = sorted(set(sources) - set(held))
    if unknown:
        raise ValueError(
            f"--sources {','.join(unknown)}: prompts {start} to {end - 1} hold no such source; they hold "
            f"{', '.join(held)}."
        )
    return [prompt for prompt in prompts if prompt.get("source") in sources]


def regenerate(args: argparse.Namespace, work: Path) -> None:
    import torch

    from hf_dflash.data.regenerate import regenerate_responses
    from hf_dflash.json_files import read_jsonl
    from hf_dflash.targets import load_target

    if args.threads < 1:
        raise ValueError(f"--threads {args.threads}: must be >= 1.")
    corpus = list(read_jsonl(args.prompts))
    start, end = prompt_range(len(corpus), args.start, args.end)
    prompts = select_prompts(corpus, start, end, args.sources)
    torch.set_num_threads(args.threads)
    record_threads(work, args.threads)
    model, tokenizer = load_target(args.target, dtype=args.dtype)
    regenerate_responses(
        model, tokenizer, prompts, work / "responses", max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size, shard_size=args.shard_size, max_prompt_tokens=args.max_prompt_tokens, seed=0,
        temperature=args.temperature,
    )  # fmt: skip


def record_threads(work: Path, threads: int) -> None:
    """Add `threads` to the thread counts the regeneration of WORK has run with (WORK/threads.json), for the
    manifest note that `--pack` writes."""
    path = work / "threads.json"
    counts = set(json.loads(path.read_text())) if path.is_file() else set()
    work.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(sorted(counts | {threads})))


def threads_used(work: Path) -> str:
    """The thread counts WORK's regeneration ran with, e.g. "2" or "1 or 2" ("an unrecorded number of" before
    they were recorded)."""
    path = work / "threads.json"
    if not path.is_file():
        return "an unrecorded number of"
    return " or ".join(str(count) for count in json.loads(path.read_text()))


def pack(args: argparse.Namespace, work: Path) -> int:
    """Tokenize the finished shards into WORK/tokenized (locked) and append them with `hf-dflash pack-data`
    (which locks the data folder); returns pack-data's exit status."""
    from hf_dflash.folder_lock import folder_lock

    if not (work / "responses" / "config.json").is_file():
        raise ValueError(f"{work / 'responses'} holds no regeneration of part {args.part}: run without --pack first.")
    with folder_lock(work / "tokenized", "regenerate_range.py --pack"):
        return tokenize_and_pack(args, work)


def tokenize_and_pack(args: argparse.Namespace, work: Path) -> int:
    from hf_dflash.data.continuous import continuous_batching_supported
    from hf_dflash.data.tokenize import tokenize_responses
    from hf_dflash.json_files import read_json_object
    from hf_dflash.targets import load_target

    model, tokenizer = load_target(args.target)  # converts the target once if this machine has not yet
    batching = "continuous batching" if continuous_batching_supported(model) else "static left-padded batches"
    data = args.data or DATA / args.target
    tokenize_responses(tokenizer, work / "responses", work / "tokenized", max_length=args.max_length, block_size=8)
    corpus = work / "corpus-record"
    corpus.mkdir(exist_ok=True)
    (corpus / "config.json").write_text((Path(args.prompts).parent / "config.json").read_text())
    settings = read_json_object(work / "responses" / "config.json", "regeneration settings")
    dtype = settings["dtype"].removeprefix("torch.")
    decoding = "greedily" if not settings["temperature"] else f"by sampling at temperature {settings['temperature']}"
    span = f"{args.start} to {args.end - 1}" if args.end is not None else f"{args.start} onwards"
    if args.sources:
        span += f" of the sources {', '.join(args.sources)}"
    note = (
        f"corpus prompts {span} ({os.path.relpath(args.prompts, REPO.parent)}), regenerated {decoding} in {dtype} with "
        f"{batching} ({args.batch_size} rows, shards of {args.shard_size}), {threads_used(work)} torch thread(s) "
        f"per job, prompts <= {args.max_prompt_tokens} tokens, <= {args.max_new_tokens} new tokens, by "
        f"scripts/regenerate_range.py; tokenized max_length {args.max_length}, block_size 8 (>= 16 supervised tokens)"
    )
    return subprocess.run(
        [sys.executable, "-m", "hf_dflash.cli", "pack-data", "--tokenized", str(work / "tokenized"), "--out", str(data),
         "--part", args.part, "--target", args.target, "--responses", str(work / "responses"), "--corpus", str(corpus),
         "--samples-per-shard", "1024", "--note", note],
        check=False, cwd=REPO,
    ).returncode  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET, choices=sorted(KNOWN_TARGETS), help="default: %(default)s")
    parser.add_argument("--part", required=True, help="the data part this range fills, e.g. regen-bf16-part5")
    parser.add_argument("--start", type=int, required=True, help="first corpus prompt (0-based)")
    parser.add_argument("--end", type=int, default=None, help="one past the last (default: the corpus end)")
    parser.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="corpus prompts.jsonl (default: %(default)s)")
    parser.add_argument(
        "--sources", type=lambda text: text.split(","), default=None,
        help="only the range's prompts of these corpus sources, comma-separated (default: all)",
    )  # fmt: skip
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_REGENERATION_BATCH)
    parser.add_argument("--shard-size", type=int, default=DEFAULT_REGENERATION_SHARD)
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sample (static batches)"
    )
    parser.add_argument("--max-length", type=int, default=1024, help="tokenized sample length (--pack)")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("REGEN_THREADS", "1")))
    parser.add_argument("--data", default=None, help="packed folder to append to (default: data/TARGET)")
    parser.add_argument("--work", default=None, help="scratch folder (default: out/regen/PART, out/regen-TARGET/PART)")
    parser.add_argument("--pack", action="store_true", help="tokenize the finished shards and pack them into data/")
    args = parser.parse_args(argv)
    regen = "regen" if args.target == DEFAULT_TARGET else f"regen-{args.target}"  # SmolLM2 keeps its old folders
    work = Path(args.work or REPO / "out" / regen / args.part)
    return run_reporting_errors("regenerate_range.py", lambda: (pack if args.pack else regenerate)(args, work))


if __name__ == "__main__":
    sys.exit(main())
