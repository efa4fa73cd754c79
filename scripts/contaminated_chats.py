"""List the packed chats whose prompt overlaps an evaluation set, as a `subset.json` for `offline_subset.py --exclude`.

The corpus was decontaminated when it was built, but against the evaluation sets known then: a chat regenerated
before a set joined the suite (IFBench, Arena-Hard) can still share a prompt with it. This re-checks every packed
chat against today's suite with the corpus's own rule (the same 13-word run, or an identical short prompt) and
writes `{"train_ids": [...], "hits": [...]}`, the form `offline_subset.py --exclude` reads, so a training subset
drawn with it never trains on an evaluation prompt.

    python scripts/contaminated_chats.py --out out/CONTAMINATED.json
    python scripts/offline_subset.py --out out/v6e/tokenized --samples 4800 --seed 10 --exclude out/CONTAMINATED.json

The prompt of a chat is the decoded text of its tokens outside the loss mask (system, user and template tokens;
the template's words are the same for every chat, so they never make a 13-word run with an evaluation prompt).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from hf_dflash.data.corpus import EvalIndex, build_eval_index, find_contamination
from hf_dflash.json_files import write_json_atomic
from hf_dflash.user_errors import run_reporting_errors

REPO = Path(__file__).resolve().parents[1]


def prompt_of(sample: dict, decode: Callable[[list[int]], str]) -> str:
    """The decoded prompt tokens (loss mask 0) of a packed sample `{"input_ids", "loss_mask"}`."""
    return decode([token for token, trained in zip(sample["input_ids"], sample["loss_mask"]) if not trained])


def contaminated_chats(samples: Iterable[dict], decode: Callable[[list[int]], str], index: EvalIndex) -> list[dict]:
    """`{"id", "reason"}` of every sample whose prompt overlaps the evaluation index, in dataset order."""
    hits = []
    for sample in samples:
        hit = find_contamination({"messages": [{"role": "user", "content": prompt_of(sample, decode)}]}, index)
        if hit is not None:
            hits.append({"id": sample["id"], "reason": hit[0]})
    return hits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(REPO / "data" / "smollm2-135m-instruct"), help="packed folder")
    parser.add_argument("--target", default="smollm2-135m-instruct", help="whose tokenizer decodes the chats")
    parser.add_argument("--out", required=True, help="JSON file to write (atomically)")
    args = parser.parse_args(argv)
    return run_reporting_errors("contaminated_chats.py", lambda: write_list(args))


def write_list(args: argparse.Namespace) -> int:
    from hf_dflash.data.packed import PackedDataset
    from hf_dflash.data.sources import load_eval_suite
    from hf_dflash.targets import load_any_target

    dataset = PackedDataset(args.data)
    _, tokenizer = load_any_target(args.target)
    if tokenizer is None:
        raise ValueError(
            f"--target {args.target} has no tokenizer to decode the chats with; name a folder that has one."
        )
    suite = load_eval_suite()
    hits = contaminated_chats(
        dataset.samples, lambda ids: tokenizer.decode(ids, skip_special_tokens=True), build_eval_index(suite)
    )
    record = {
        "settings": {"data": str(args.data), "target": args.target, "eval_sets": sorted(suite)},
        "chats": len(dataset.samples),
        "train_ids": [hit["id"] for hit in hits],
        "hits": hits,
    }
    write_json_atomic(Path(args.out), record)
    for hit in hits:
        print(f"{hit['id']}: {hit['reason']}")
    print(f"{len(hits)} of {len(dataset.samples)} chats overlap an evaluation set; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
