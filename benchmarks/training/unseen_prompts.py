"""Write the bench's prompt sets as a regeneration prompts file: unseen prompts turned into held-out chats.

The bench measures a drafter's τ on prompts the project never trained on, one drafter per run, and under sampling
each run draws its own replies (noise of a few per cent at 32 prompts). Regenerating the target's replies to the same
prompts once and scoring every drafter on them offline (`heldout_tau.py`: served-walk τ for greedy replies, the
expected τ under sampling for sampled ones) compares drafters on identical text, deterministically, for one target
forward per chat; on the same prompts the estimate and the bench agree (`heldout_prompts.py`). Each record keeps
the bench's prompt (multi-turn sets keep every user turn) under the id "<set>:<bench id>":

    python benchmarks/training/unseen_prompts.py --sets long-docs,long-code --num-prompts 12 \\
        --out out/unseen/long.jsonl
    OMP_WAIT_POLICY=PASSIVE python scripts/regenerate_range.py --part unseen-long-greedy --start 0 \\
        --prompts out/unseen/long.jsonl --max-new-tokens 256 --max-prompt-tokens 3584 --max-length 4096 \\
        --data out/unseen/data --work out/unseen/regen/unseen-long-greedy
    python scripts/regenerate_range.py --part unseen-long-greedy --start 0 --prompts out/unseen/long.jsonl \\
        --max-length 4096 --data out/unseen/data --work out/unseen/regen/unseen-long-greedy --pack
    python benchmarks/training/heldout_tau.py models/smollm2-135m-instruct-dflash checkpoints/... \\
        --data out/unseen/data --eval-part unseen-long-greedy --samples 24
"""

import argparse
import json
from pathlib import Path

from hf_dflash.bench.prompts import load_prompt_sets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", required=True, help="comma-separated bench sets (hf-dflash bench --sets)")
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts per set, drawn as the bench draws them")
    parser.add_argument("--seed", type=int, default=0, help="the bench's --seed (the same prompts as its runs)")
    parser.add_argument(
        "--out", required=True, help="JSONL to write ({'id', 'source', 'messages'} per line; config.json beside it)"
    )
    args = parser.parse_args()
    sets = [name for name in args.sets.split(",") if name]
    prompt_sets = load_prompt_sets(sets, num_prompts=args.num_prompts, seed=args.seed)
    lines = [
        json.dumps({"id": f"{name}:{record['id']}", "source": name, "messages": record["messages"]})
        for name, records in prompt_sets.items()
        for record in records
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    record = {  # the corpus record regenerate_range.py --pack files with the part
        "source_prompts": "hf-dflash bench sets (hf_dflash.bench.prompts)",
        "sets": sets,
        "num_prompts_per_set": args.num_prompts,
        "seed": args.seed,
        "num_prompts": len(lines),
        "per_source": {name: len(records) for name, records in prompt_sets.items()},
    }
    (Path(args.out).parent / "config.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"{args.out}: {len(lines)} prompts ({', '.join(f'{n} {len(r)}' for n, r in prompt_sets.items())})")


if __name__ == "__main__":
    main()
