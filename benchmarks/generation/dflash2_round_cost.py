"""What DFlash2's parts cost a served round: DFlash against DFlash2, timed in turn on the same target.

One served round (`hf_dflash.generation.policies.cost_timing.measure_round_seconds`): the drafter pass over a block of
B after a 256-token context, its drafts (the argmax chain, or DFlash2's selector walk), and the target's
verification of B tokens. The DFlash2 drafter is a trained one (`--dflash2`) or, without it, the DFlash
drafter upgraded at identity (`dflash2_from_dflash`: the same convolutions and walk as a trained one, so
the same cost). Each timing is the fastest of `--repeats` rounds, the drafters alternating `--turns` times;
the figure is the median turn. Prints a table and writes JSON:

    python benchmarks/generation/dflash2_round_cost.py \\
        --drafter models/smollm2-135m-instruct-dflash --dtype bfloat16 --out out/dflash2_round_cost.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from hf_dflash.bench.loading import machine_description
from hf_dflash.checkpoints import load_drafter
from hf_dflash.generation.policies.cost_timing import measure_round_seconds
from hf_dflash.json_files import write_json_atomic
from hf_dflash.packed_linears import packed_linears
from hf_dflash.targets import load_target
from hf_dflash.trainer.upgrade import dflash2_from_dflash


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default="models/smollm2-135m-instruct-dflash", help="the DFlash drafter")
    parser.add_argument("--dflash2", default=None, help="a DFlash2 drafter (default: --drafter upgraded)")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--selector-rank", type=int, default=64)
    parser.add_argument("--selector-top-k", type=int, default=16)
    parser.add_argument("--turns", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="out/dflash2_round_cost.json")
    args = parser.parse_args()

    target, _ = load_target(args.target, dtype=args.dtype)
    dflash = load_drafter(args.drafter).to(target.dtype).eval()
    if args.dflash2:
        dflash2 = load_drafter(args.dflash2).to(target.dtype).eval()
    else:
        sizes = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=args.selector_rank)
        dflash2 = dflash2_from_dflash(dflash, **sizes, selector_top_k=args.selector_top_k).eval()
    block = dflash.config.block_size
    seconds = {"DFlash": [], "DFlash2": []}
    with packed_linears(target) if target.dtype == torch.float32 else torch.no_grad():
        for _ in range(args.turns):
            for name, drafter in (("DFlash", dflash), ("DFlash2", dflash2)):
                seconds[name].append(measure_round_seconds(target, drafter, 1, [block], repeats=args.repeats)[0])
    median = {name: statistics.median(values) for name, values in seconds.items()}
    ratio = median["DFlash2"] / median["DFlash"]
    print(f"\n{args.target}, {target.dtype}, block {block}, {torch.get_num_threads()} threads\n")
    print("| drafter | round ms (median of turns) | × DFlash |\n|---|---|---|")
    for name, value in median.items():
        print(f"| {name} | {value * 1e3:.1f} | {value / median['DFlash']:.3f} |")
    result = {
        "settings": {**vars(args), "dtype": str(target.dtype), "block_size": block},
        "machine": machine_description(target.device),
        "seconds": seconds,
        "median_seconds": median,
        "dflash2_over_dflash": round(ratio, 4),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(Path(args.out), result)


if __name__ == "__main__":
    main()
