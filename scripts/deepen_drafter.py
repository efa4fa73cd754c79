"""Add decoder layers to a trained drafter without changing what it drafts, to train a deeper drafter from it.

A drafter's depth is a budget question (docs/drafter-history.md: at 16 CPU-minutes from scratch one layer learns
fastest; v1's GPU run preferred five). Training a deeper drafter from scratch throws away every cycle the shallow one
was trained for; growing it keeps them. Each new layer is appended after the last one with its output projections
zero (`hf_dflash.trainer.upgrade.deeper_drafter`), so the deeper drafter's outputs equal the source's exactly until
training moves them:

    python scripts/deepen_drafter.py models/smollm2-135m-instruct-dflash --add-layers 1 --out out/deep3/init
    # then train from it: `drafter: {init_from: out/deep3/init}` in a `hf-dflash train` YAML

The source's training record is not copied: the grown drafter has not been trained as it stands.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from hf_dflash.checkpoints import load_drafter
from hf_dflash.checkpoints.converting import check_destination
from hf_dflash.checkpoints.hub import save_hub
from hf_dflash.trainer.upgrade import deeper_drafter
from hf_dflash.user_errors import run_reporting_errors


def deepen_drafter(source: str, out_dir: str | Path, add_layers: int, dtype: str = "float32") -> Path:
    """Load the drafter at `source` (fp32), append `add_layers` identity layers, save it to `out_dir` (new)."""
    check_destination(source, Path(out_dir), overwrite=False)
    grown = deeper_drafter(load_drafter(source, dtype=torch.float32), add_layers)
    return save_hub(grown, Path(out_dir), dtype=getattr(torch, dtype))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafter", help="drafter folder (either checkpoint format)")
    parser.add_argument("--add-layers", type=int, default=1, help="decoder layers to append (default 1)")
    parser.add_argument("--out", required=True, help="new output folder (Hub-native drafter)")
    parser.add_argument("--dtype", default="float32", choices=("bfloat16", "float32"), help="saved weights' dtype")
    args = parser.parse_args(argv)

    def work() -> None:
        out = deepen_drafter(args.drafter, args.out, args.add_layers, args.dtype)
        print(f"Wrote {args.drafter} with {args.add_layers} more layer(s) to {out}")

    return run_reporting_errors("deepen_drafter.py", work)


if __name__ == "__main__":
    sys.exit(main())
