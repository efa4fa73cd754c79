"""Average the weights of drafters trained from one starting point (a "model soup") into one Hub-native drafter.

Two training cycles that start from the same weights on different draws of the data land in one basin: their mean
often accepts more than either (the seventh and eighth v6 cycles, both from the sixth: held-out served τ 3.368 and
3.403, their mean 3.471; docs/drafter-history.md). Every drafter must have the same architecture (the same config
apart from its dtype and serving settings) and the same draft vocabulary; the mean is taken in fp32 and saved in
`--dtype` (default bfloat16):

    python scripts/average_drafters.py models/smollm2-135m-instruct-dflash out/v6h/n64 --out out/soup
    python benchmarks/training/heldout_tau.py out/soup --eval-part regen-bf16-part2 --samples 64

The first drafter's config (with its serving recommendation, `block_size_policy`) is the result's; its training
record (for `hf-dflash export`'s card) is the last source's that has one, naming every source under `averaged_from`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from hf_dflash.checkpoints import load_drafter
from hf_dflash.checkpoints.converting import check_destination
from hf_dflash.checkpoints.hub import save_hub
from hf_dflash.hub_cards.schemas import TRAINING_RECORD_NAME, load_training_record
from hf_dflash.packaged_files import file_sha256
from hf_dflash.user_errors import run_reporting_errors

# Config fields that do not shape the weights (where it was loaded from, dtype, serving settings): they may differ.
NOT_ARCHITECTURE = ("_name_or_path", "dtype", "torch_dtype", "block_size_policy", "use_cache", "transformers_version")


def architecture(config) -> dict:
    """The config fields that shape the weights (everything but `NOT_ARCHITECTURE`)."""
    return {key: value for key, value in config.to_dict().items() if key not in NOT_ARCHITECTURE}


def check_same_architecture(configs: Sequence, names: Sequence[str]) -> None:
    """ValueError naming the first field where a drafter's config differs from the first one's."""
    first = architecture(configs[0])
    for config, name in zip(configs[1:], names[1:], strict=True):
        other = architecture(config)
        for key in sorted(set(first) | set(other)):
            if first.get(key) != other.get(key):
                raise ValueError(
                    f"{name} has {key}={other.get(key)!r} where {names[0]} has {first.get(key)!r}: only drafters "
                    "of one architecture (trained from one starting point) can be averaged."
                )


def check_same_draft_vocab(drafters: Sequence, names: Sequence[str]) -> None:
    """ValueError naming a drafter whose draft vocabulary (the target ids of `d2t`) differs from the first one's:
    the mean of two vocabularies' `d2t`/`t2d` buffers is no vocabulary, and the rows of the mean drafter's outputs
    would score other tokens than either was trained on."""
    first = drafters[0].draft_token_ids
    for drafter, name in zip(drafters[1:], names[1:], strict=True):
        ids = drafter.draft_token_ids
        if first is None or ids is None or torch.equal(first, ids):
            continue  # a whole-vocabulary drafter beside a pruned one differs in draft_vocab_size (architecture)
        only_here, only_first = (len(set(a.tolist()) - set(b.tolist())) for a, b in ((ids, first), (first, ids)))
        raise ValueError(
            f"{name} drafts over another draft vocabulary than {names[0]} (d2t: {only_here} ids only in {name}, "
            f"{only_first} only in {names[0]}): only drafters with one draft vocabulary can be averaged (training "
            "from one starting point, `drafter.init_from`, keeps its draft vocabulary)."
        )


def average_state_dicts(state_dicts: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The element-wise fp32 mean of state dicts with the same keys and shapes."""
    keys = set(state_dicts[0])
    for state_dict in state_dicts[1:]:
        if set(state_dict) != keys:
            raise ValueError(f"the drafters' weights differ in names: {sorted(keys ^ set(state_dict))[:5]}")
    return {key: torch.stack([sd[key].float() for sd in state_dicts]).mean(0) for key in state_dicts[0]}


def average_drafters(paths: Sequence[str], out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Load every drafter (fp32), check one architecture, save the mean of their weights to `out_dir` (new)."""
    if len(paths) < 2:
        raise ValueError(f"average_drafters needs at least two drafters, got {len(paths)}.")
    out_dir = Path(out_dir)
    for path in paths:  # never write over a checkpoint, nor into a folder holding one of the sources
        check_destination(path, out_dir, overwrite=False)
    drafters = [load_drafter(path, dtype=torch.float32) for path in paths]
    check_same_architecture([drafter.config for drafter in drafters], [str(path) for path in paths])
    check_same_draft_vocab(drafters, [str(path) for path in paths])
    soup = drafters[0]
    soup.load_state_dict(average_state_dicts([drafter.state_dict() for drafter in drafters]))
    out = save_hub(soup, out_dir, dtype=getattr(torch, dtype))
    if (record := averaged_record(paths)) is not None:
        (out / TRAINING_RECORD_NAME).write_text(json.dumps(record, indent=2) + "\n")
    return out


def averaged_record(paths: Sequence[str]) -> dict | None:
    """The training record of the mean: the last source's that has one (its run, data and settings), with every
    source's path and weights' sha256 under `averaged_from`; None where no source has a record."""
    records = [Path(path) / TRAINING_RECORD_NAME for path in paths if (Path(path) / TRAINING_RECORD_NAME).is_file()]
    if not records:
        return None
    sources = []
    for path in paths:
        weights = Path(path) / "model.safetensors"
        sources.append({"path": str(path), **({"weights_sha256": file_sha256(weights)} if weights.is_file() else {})})
    return load_training_record({**load_training_record(records[-1]), "averaged_from": sources})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("drafters", nargs="+", help="drafter folders (either checkpoint format), one architecture")
    parser.add_argument("--out", required=True, help="new output folder (Hub-native drafter)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="saved weights' dtype")
    args = parser.parse_args(argv)

    def work() -> None:
        out = average_drafters(args.drafters, args.out, args.dtype)
        print(f"Wrote the mean of {len(args.drafters)} drafters to {out}")

    return run_reporting_errors("average_drafters.py", work)


if __name__ == "__main__":
    sys.exit(main())
