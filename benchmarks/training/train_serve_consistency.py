"""Train/serve consistency on real held-out chats: the trainer's τ estimates vs the τ `generate` serves.

For the last `--samples` chats of a packed data folder (held out from training by `eval_samples`), prints
per chat and overall:
  uniform  the mean τ over every reply anchor (what uniform anchor sampling estimates),
  walk     the serving-walk estimate (anchors visited p -> p + τ(p), as generate does),
  served   the τ `generate(assistant_model=drafter)` reports on the same prompts (each reply span
           regenerated after the conversation before it, max_new_tokens = the reply's length).
The walk equals the served τ when the target reproduces the stored reply (greedy, same dtype as the
data); a reply the target does not reproduce is flagged and excluded from the comparison. A gap over 3%
on reproduced replies is a bug. Writes JSON.

    python benchmarks/training/train_serve_consistency.py --drafter models/smollm2-135m-instruct-dflash \
        --data data/smollm2-135m-instruct --samples 12 --dtype float32 --out out/consistency.json
"""

import argparse
import json
from pathlib import Path

import torch

from hf_dflash.checkpoints import load_drafter
from hf_dflash.data.packed import PackedDataset
from hf_dflash.dtypes import describe_dtype
from hf_dflash.targets import load_target
from hf_dflash.trainer.consistency import reply_spans, served_tau_estimate


@torch.no_grad()
def serve(target, drafter, sample: dict) -> tuple[list[int], bool]:
    """τ of every round `generate` runs over the sample's replies, and whether every reply was reproduced."""
    ids = torch.tensor([sample["input_ids"]])
    rounds, reproduced = [], True
    for start, end in reply_spans(sample["loss_mask"]):
        out = target.generate(
            ids[:, :start],
            attention_mask=torch.ones(1, start, dtype=torch.long),
            do_sample=False,
            max_new_tokens=end - start,
            assistant_model=drafter,
            eos_token_id=None,
            pad_token_id=target.generation_config.pad_token_id or 0,
        )
        reproduced &= torch.equal(out[0, start:end], ids[0, start:end])
        rounds += drafter.last_acceptance.acceptance_lengths
    return rounds, reproduced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default="models/smollm2-135m-instruct-dflash")
    parser.add_argument("--data", default="data/smollm2-135m-instruct")
    parser.add_argument("--samples", type=int, default=12)
    parser.add_argument("--parts", default=None, help="comma-separated parts of the packed folder (default: all)")
    parser.add_argument("--dtype", default="float32", help="the dtype the data was regenerated in (exact walk)")
    parser.add_argument("--out", default="out/consistency.json")
    args = parser.parse_args()

    target, _ = load_target(dtype=args.dtype)
    drafter = load_drafter(args.drafter).to(target.dtype).eval()
    drafter.block_size_policy = drafter.config.block_size  # the walk models a fixed block size
    data = PackedDataset(args.data, parts=args.parts.split(",") if args.parts else None)
    samples = [data[i] for i in range(len(data) - args.samples, len(data))]
    rows = []
    print(f"target {describe_dtype(args.dtype)}; drafter {args.drafter} (block {drafter.config.block_size})")
    print(f"{'sample':>28} {'uniform':>8} {'walk':>6} {'served':>7} {'rounds':>7} reproduced")
    for sample in samples:
        estimate = served_tau_estimate(drafter, target, [sample])
        rounds, reproduced = serve(target, drafter, sample)
        served = sum(rounds) / len(rounds)
        rows.append(
            {
                "id": sample["id"],
                "uniform": estimate.uniform_tau,
                "walk": estimate.served_tau,
                "served": served,
                "walk_rounds": estimate.rounds,
                "served_rounds": rounds,
                "reproduced": reproduced,
            }
        )
        print(
            f"{sample['id'][:28]:>28} {estimate.uniform_tau:>8.3f} {estimate.served_tau:>6.3f} {served:>7.3f} "
            f"{len(rounds):>7} {'yes' if reproduced else 'NO'}"
        )
    same = [row for row in rows if row["reproduced"]]

    def pooled(key_rounds: str) -> float:
        values = [t for row in same for t in row[key_rounds]]
        return sum(values) / max(len(values), 1)

    uniform = sum(row["uniform"] for row in same) / max(len(same), 1)
    walk, served = pooled("walk_rounds"), pooled("served_rounds")
    identical = sum(row["walk_rounds"] == row["served_rounds"] for row in same)
    print(
        f"reproduced {len(same)}/{len(rows)} chats: uniform-anchor τ {uniform:.3f} | walk estimate {walk:.3f} | "
        f"served {served:.3f} | gap {100 * (walk - served) / served:+.2f}% | identical round lists {identical}/{len(same)}"
    )
    result = {
        "settings": vars(args),
        "samples": rows,
        "overall": {
            "reproduced": len(same),
            "uniform_tau": uniform,
            "walk_tau": walk,
            "served_tau": served,
            "identical_round_lists": identical,
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
