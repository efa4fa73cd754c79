"""Add decoder layers to a trained drafter without changing what it drafts, to train a deeper drafter from it.

A drafter's depth is a budget question (docs/drafter-history.md: at 16 CPU-minutes from scratch one layer learns
fastest; v1's GPU run preferred five). Training a deeper drafter from scratch throws away every cycle the shallow one
was trained for; growing it keeps them. Each new layer is appended after the last one, initialised as a fresh layer
but with its two output projections (`self_attn.o_proj`, `mlp.down_proj`) zero: its residual branch adds nothing, so
the deeper drafter's outputs equal the source's exactly until training moves them (the zero projections receive
gradients at once, the rest of the layer as soon as they leave zero):

    python scripts/deepen_drafter.py models/smollm2-135m-instruct-dflash --add-layers 1 --out out/deep3/init
    # then train from it: `drafter: {init_from: out/deep3/init}` in a `hf-dflash train` YAML

Each new layer's type is the last layer's (full or sliding attention). The source's training record is not copied:
the grown drafter has not been trained as it stands.
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
from hf_dflash.modeling_dflash.modeling_dflash import DFlashDraftModel
from hf_dflash.user_errors import run_reporting_errors


def deepened(drafter: DFlashDraftModel, add_layers: int) -> DFlashDraftModel:
    """A drafter with `add_layers` more decoder layers after the source's, drafting exactly as the source does.

    Raises:
        ValueError: `add_layers` is not a positive integer.
    """
    if isinstance(add_layers, bool) or not isinstance(add_layers, int) or add_layers < 1:
        raise ValueError(f"--add-layers {add_layers!r}: must be a positive integer (the decoder layers to append).")
    config = drafter.config.__class__.from_dict(drafter.config.to_dict())
    depth = config.num_hidden_layers
    config.num_hidden_layers = depth + add_layers
    config.layer_types = list(config.layer_types) + [config.layer_types[-1]] * add_layers
    grown = DFlashDraftModel(config).to(drafter.fc.weight.dtype)
    missing, unexpected = grown.load_state_dict(drafter.state_dict(), strict=False)
    new_prefixes = tuple(f"layers.{index}." for index in range(depth, depth + add_layers))
    if unexpected or any(not key.startswith(new_prefixes) for key in missing):
        raise ValueError(f"the source drafter's weights do not fit its own config: {unexpected or missing}")
    with torch.no_grad():
        for layer in grown.layers[depth:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return grown.eval()


def deepen_drafter(source: str, out_dir: str | Path, add_layers: int, dtype: str = "float32") -> Path:
    """Load the drafter at `source` (fp32), append `add_layers` identity layers, save it to `out_dir` (new)."""
    check_destination(source, Path(out_dir), overwrite=False)
    grown = deepened(load_drafter(source, dtype=torch.float32), add_layers)
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
