"""Cut a corpus down to the prompts whose rendered length lies in a token band, for a regeneration part of its own.

The committed SmolLM2 parts were regenerated with prompts <= 512 rendered tokens: the longer corpus prompts (users
pasting a document, a code file, a long task; ~6% of the corpus) were skipped, so the drafter never saw a long
context. This writes those prompts as a corpus folder (`prompts.jsonl` + `config.json` naming the band, the source
corpus and its sha256) that `scripts/regenerate_range.py --prompts` reads:

    python scripts/length_band_corpus.py --out out/corpus-long --min-tokens 513 --max-tokens 3584
    OMP_WAIT_POLICY=PASSIVE nice -n 19 python scripts/regenerate_range.py --part regen-bf16-part20 --start 0 \\
        --prompts out/corpus-long/prompts.jsonl --max-prompt-tokens 3584 --max-length 4096 --batch-size 16 &

`--id-suffix` gives every record a distinct id (e.g. `@t0.8` for a sampled part over the same prompts), since a
packed data folder holds each sample id once. Prompts keep the source corpus's order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

from hf_dflash.targets import DEFAULT_TARGET, KNOWN_TARGETS
from hf_dflash.user_errors import run_reporting_errors

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PROMPTS = REPO.parent / "shared" / "data" / "smollm2-regen-fp32-part0" / "corpus" / "prompts.jsonl"


def in_band(lengths: list[int], min_tokens: int, max_tokens: int) -> list[int]:
    """Indices of the lengths in [min_tokens, max_tokens], in order."""
    if not 1 <= min_tokens <= max_tokens:
        raise ValueError(f"--min-tokens {min_tokens} / --max-tokens {max_tokens}: need 1 <= min <= max.")
    return [i for i, length in enumerate(lengths) if min_tokens <= length <= max_tokens]


def build(args: argparse.Namespace) -> None:
    from hf_dflash.data.regenerate import render_conversation
    from hf_dflash.json_files import read_jsonl, write_atomic
    from hf_dflash.targets import load_target

    out = Path(args.out)
    if (out / "prompts.jsonl").exists():
        raise ValueError(f"{out / 'prompts.jsonl'} exists: choose another --out (a corpus is never rewritten).")
    _, tokenizer = load_target(args.target)
    corpus = list(read_jsonl(args.prompts))
    lengths = [
        len(tokenizer(render_conversation(tokenizer, p["messages"], add_generation_prompt=True), add_special_tokens=False)["input_ids"])
        for p in corpus
    ]  # fmt: skip
    kept = [
        dict(corpus[i], id=corpus[i]["id"] + args.id_suffix) for i in in_band(lengths, args.min_tokens, args.max_tokens)
    ]
    config = {
        "source_prompts": os.path.relpath(args.prompts, REPO.parent),
        "source_prompts_sha256": hashlib.sha256(Path(args.prompts).read_bytes()).hexdigest(),
        "target": args.target,
        "rendered_tokens": [args.min_tokens, args.max_tokens],
        "id_suffix": args.id_suffix,
        "num_prompts": len(kept),
        "per_source": {s: sum(p["source"] == s for p in kept) for s in sorted({p["source"] for p in kept})},
    }
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "prompts.jsonl", "".join(json.dumps(p) + "\n" for p in kept))
    write_atomic(out / "config.json", json.dumps(config, indent=2) + "\n")
    print(json.dumps(config, indent=2))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="corpus folder to write (prompts.jsonl, config.json)")
    parser.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="source corpus (default: %(default)s)")
    parser.add_argument("--target", default=DEFAULT_TARGET, choices=sorted(KNOWN_TARGETS))
    parser.add_argument("--min-tokens", type=int, default=513, help="shortest rendered prompt kept")
    parser.add_argument("--max-tokens", type=int, default=3584, help="longest rendered prompt kept")
    parser.add_argument("--id-suffix", default="", help="appended to every id (a second part over the same prompts)")
    args = parser.parse_args(argv)
    return run_reporting_errors("length_band_corpus.py", lambda: build(args))


if __name__ == "__main__":
    sys.exit(main())
