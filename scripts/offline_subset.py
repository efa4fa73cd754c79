"""Unpack a seeded subset of the committed packed chats into `tokenized-*.jsonl`, for offline features.

`hf-dflash cache-features` reads tokenised JSONL; the committed data is a packed folder. On a CPU,
caching all 14.9 k chats would take ~50 minutes and ~35 GB, and the learning curve says a few thousand
chats seen several times teach a CPU-budget drafter as much as the whole set, so this writes a seeded
random subset of the training chats, then the fixed held-out chats (the first `--eval-samples` of
`--eval-part`) as the last file, `tokenized-99999.jsonl`: a training config with
`data.eval_samples: <the same count>` holds out exactly those (it takes the last samples).

    python scripts/offline_subset.py --out out/offline/tokenized --samples 6000
    hf-dflash cache-features --data out/offline/tokenized --out out/offline/features --batch-size 8

`--exclude DIR/subset.json` (repeatable) leaves out the training chats of earlier subsets, so a drafter
trained further from an earlier one's weights sees only chats it has not seen (the chats neither v2's
nor v3's subset drew: `--samples 5275 --seed 2 --exclude` both their subset.json files; a subset.json is
re-made by running this script again with that subset's settings). `--parts A,B` draws only from those
parts (new data for a drafter that saw the others); `--reserve PART` never draws the first
`--eval-samples` chats of PART, a second fixed held-out set (`heldout_tau.py --eval-part PART`), and
`--reserve PART:N` the first N (a scarce part keeps more of its chats for training), `--reserve PART:-N` the last N
(the set `heldout_tau.py --parts PART --samples N` scores); both ends of one part may be reserved (`PART:N` beside
`PART:-M`: a growing part's chats an earlier subset saw, and those packed after it). `--include-all PART`
(repeatable) puts every chat of PART that is not held out, reserved or excluded in the training subset, beside the
`--samples` drawn from the other parts: a small new part (long prompts, sampled replies) is then not left to the draw;
`--samples 0` writes the included parts alone (a part packed after a subset was drawn, to add to it).

Files are written under temporary names and renamed when complete; `subset.json` (written last) records
the settings and the chosen sample ids. Re-running with the same settings leaves a finished folder alone;
other settings on a folder that holds tokenised files are refused (choose another --out).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from hf_dflash.data.packed import PackedDataset
from hf_dflash.folder_lock import folder_lock
from hf_dflash.json_files import read_json_object, write_atomic, write_json_atomic
from hf_dflash.output_paths import check_output_folder
from hf_dflash.user_errors import run_reporting_errors

REPO = Path(__file__).resolve().parents[1]

RECORD = "subset.json"
HELD_OUT_FILE = "tokenized-99999.jsonl"
SAMPLES_PER_FILE = 1000


def choose_subset(
    parts: list[str],
    count: int,
    seed: int,
    eval_part: str,
    eval_samples: int,
    exclude: set[int] = frozenset(),
    train_parts: set[str] | None = None,
    reserved_parts: tuple[str, ...] | dict[str, int | tuple[int, ...]] = (),
    whole_parts: tuple[str, ...] = (),
) -> tuple[list[int], list[int]]:
    """(training indices, held-out indices) of a packed dataset whose sample i belongs to `parts[i]`.

    Held out: the first `eval_samples` of `eval_part` (the fixed held-out set of the recipe comparison
    and learning curve). Training: `count` of the others not in `exclude`, drawn with
    `random.Random(seed)`, in dataset order; only from `train_parts` when given. The first `eval_samples`
    of each of `reserved_parts` (or the count, or counts, a dict gives per part; a negative count -N: its last N) are
    never drawn either (a second fixed held-out set, scored apart). Every eligible sample of `whole_parts` is in the
    training list, beside the `count` drawn from the other parts.
    """
    if isinstance(eval_samples, bool) or not isinstance(eval_samples, int) or eval_samples < 0:
        raise ValueError(f"--eval-samples {eval_samples}: must be a count >= 0 (the held-out chats of --eval-part).")
    held_out = [i for i, part in enumerate(parts) if part == eval_part][:eval_samples]
    if len(held_out) < eval_samples:
        raise ValueError(
            f"--eval-part {eval_part} has {len(held_out)} samples, fewer than --eval-samples {eval_samples}."
        )
    reserve_counts = reserved_parts if isinstance(reserved_parts, dict) else dict.fromkeys(reserved_parts, eval_samples)
    unknown = sorted((set(train_parts or ()) | set(reserve_counts) | set(whole_parts)) - set(parts))
    if unknown:
        raise ValueError(f"Part(s) {unknown} are not in the packed data; its parts: {sorted(set(parts))}.")
    reserved = [
        i
        for part, counts in reserve_counts.items()
        for n in (counts if isinstance(counts, tuple) else (counts,))
        for i in first_or_last([j for j, p in enumerate(parts) if p == part], n)
    ]
    excluded = set(held_out) | set(exclude) | set(reserved)
    whole = [i for i in range(len(parts)) if i not in excluded and parts[i] in whole_parts]
    candidates = [
        i
        for i in range(len(parts))
        if i not in excluded and parts[i] not in whole_parts and (train_parts is None or parts[i] in train_parts)
    ]
    if count == 0 and not whole:
        raise ValueError("--samples 0 draws nothing: name the parts to take whole with --include-all.")
    if not 0 <= count <= len(candidates):
        raise ValueError(f"--samples {count}: choose between 1 and the {len(candidates)} training samples.")
    return sorted(whole + random.Random(seed).sample(candidates, count)), held_out


def first_or_last(indices: list[int], n: int) -> list[int]:
    """The first n of `indices` (n > 0) or the last -n (n < 0)."""
    return indices[:n] if n > 0 else indices[n:]


def parse_reserve(values: list[str], eval_samples: int) -> dict[str, tuple[int, ...]]:
    """`--reserve PART`, `PART:N` or `PART:-N` values -> {part: (chats held out, negative for the last ones)}; N
    defaults to `--eval-samples`. A part may be reserved once at each end."""
    counts: dict[str, tuple[int, ...]] = {}
    for value in values:
        part, _, n = value.partition(":")
        if n and not (n.removeprefix("-").isdigit() and int(n) != 0):
            raise ValueError(
                f"--reserve {value}: the count after ':' must be a whole number other than 0 (PART, PART:N for the "
                "first N chats, PART:-N for the last N)."
            )
        count = int(n) if n else eval_samples
        if any((earlier > 0) == (count > 0) for earlier in counts.get(part, ())):
            end = "first" if count > 0 else "last"
            raise ValueError(
                f"--reserve {value}: {part} is reserved twice from its {end} chats; give one count per end "
                "(PART:N for the first N, PART:-M for the last M)."
            )
        counts[part] = (*counts.get(part, ()), count)
    return counts


def read_train_ids(path: Path) -> set[str]:
    """The training chat ids recorded in an earlier run's `subset.json`."""
    try:
        ids = json.loads(path.read_text())["train_ids"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"--exclude {path}: not a readable subset.json with train_ids ({error})") from None
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise ValueError(f"--exclude {path}: train_ids must be a list of sample ids")
    return set(ids)


def write_jsonl(path: Path, samples: list[dict]) -> None:
    lines = (json.dumps({key: sample[key] for key in ("id", "input_ids", "loss_mask")}) + "\n" for sample in samples)
    write_atomic(path, "".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(REPO / "data" / "smollm2-135m-instruct"), help="packed folder")
    parser.add_argument("--out", required=True, help="folder for tokenized-*.jsonl (created)")
    parser.add_argument(
        "--samples", type=int, required=True, help="training chats to draw (0: only the --include-all parts)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-part", default="regen-bf16-part2", help="part whose first chats are held out")
    parser.add_argument("--eval-samples", type=int, default=64)
    parser.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="SUBSET_JSON",
        help="subset.json of an earlier subset: none of its training chats are drawn (repeatable)",
    )
    parser.add_argument("--parts", default=None, help="comma-separated parts to draw from (default: all)")
    parser.add_argument(
        "--reserve",
        action="append",
        default=[],
        metavar="PART",
        help="never draw the first --eval-samples (or N) chats of PART, given as PART or PART:N, or its last N "
        "as PART:-N (a second held-out set; repeatable, once per end of a part)",
    )
    parser.add_argument(
        "--include-all",
        action="append",
        default=[],
        metavar="PART",
        help="train on every eligible chat of PART, beside the --samples drawn from the other parts (repeatable)",
    )
    args = parser.parse_args(argv)
    return run_reporting_errors("offline_subset.py", lambda: write_subset(args))


def write_subset(args: argparse.Namespace) -> int:
    """The script's work; a bad argument or file is a ValueError / OSError (`main` prints it, exit 2)."""
    out = check_output_folder(args.out)
    if args.eval_samples < 0:
        raise ValueError(f"--eval-samples {args.eval_samples}: must be a count >= 0.")
    if args.samples < 0:
        raise ValueError(f"--samples {args.samples}: must be >= 0 (0: the --include-all parts alone).")
    excluded_ids = {path: read_train_ids(Path(path)) for path in args.exclude}
    with folder_lock(out, "offline_subset.py"):  # the checks below and the writes: one writer at a time
        return write_locked(args, out, excluded_ids)


def write_locked(args: argparse.Namespace, out: Path, excluded_ids: dict[str, set[str]]) -> int:
    settings = {
        "data": str(args.data),
        "samples": args.samples,
        "seed": args.seed,
        "eval_part": args.eval_part,
        "eval_samples": args.eval_samples,
    }
    if excluded_ids:  # recorded only when given: folders written before --exclude keep their settings
        settings["exclude"] = [{"path": path, "train_ids": len(ids)} for path, ids in excluded_ids.items()]
    train_parts = sorted(set(args.parts.split(","))) if args.parts else None
    if train_parts:  # likewise
        settings["parts"] = train_parts
    if args.reserve:
        settings["reserve"] = list(args.reserve)
    if args.include_all:
        settings["include_all"] = sorted(set(args.include_all))
    record_path = out / RECORD
    if record_path.is_file():
        if read_json_object(record_path, "subset record").get("settings") == settings:
            print(f"{out} already holds this subset; leaving it alone.")
            return 0
        raise ValueError(f"{out} holds another subset ({record_path}); choose another --out.")
    if out.is_dir() and any(out.glob("tokenized-*.jsonl")):
        raise ValueError(f"{out} holds tokenized files this script did not finish; choose another --out.")
    dataset = PackedDataset(args.data)
    unwanted = set().union(*excluded_ids.values())
    exclude = {i for i, sample in enumerate(dataset.samples) if sample["id"] in unwanted}
    train, held_out = choose_subset(
        dataset.parts,
        args.samples,
        args.seed,
        args.eval_part,
        args.eval_samples,
        exclude,
        None if train_parts is None else set(train_parts),
        parse_reserve(args.reserve, args.eval_samples),
        tuple(sorted(set(args.include_all))),
    )
    for start in range(0, len(train), SAMPLES_PER_FILE):
        chunk = [dataset[i] for i in train[start : start + SAMPLES_PER_FILE]]
        write_jsonl(out / f"tokenized-{start // SAMPLES_PER_FILE:05d}.jsonl", chunk)
    write_jsonl(out / HELD_OUT_FILE, [dataset[i] for i in held_out])
    tokens = sum(len(dataset[i]["input_ids"]) for i in train)
    record = {
        "settings": settings,
        "train_samples": len(train),
        "train_tokens": tokens,
        "held_out_ids": [dataset[i]["id"] for i in held_out],
        "train_ids": [dataset[i]["id"] for i in train],
    }
    write_json_atomic(record_path, record)
    print(f"Wrote {len(train)} training chats ({tokens} tokens) and {len(held_out)} held-out chats (last) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
