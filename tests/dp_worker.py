"""Worker for the data-parallel test: one SGD step of DFlashTrainer, drafter weights saved to argv[1].

Run under `accelerate launch --cpu --num_processes 2` (gloo) or as a plain single process.
"""

import sys
from pathlib import Path

from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_dflash.trainer import DFlashTrainer  # noqa: E402
from tests.conftest import make_drafter, make_target  # noqa: E402
from tests.helpers.training import BLOCK, arguments, finish_launched_worker, samples  # noqa: E402


def main(out_file: str, per_device_batch: int) -> None:
    target = make_target("llama")
    drafter = make_drafter(target, block_size=BLOCK)
    args = arguments(
        Path(out_file).parent / "run",
        max_steps=1,
        num_anchors=64,
        optim="sgd",
        learning_rate=1.0,
        per_device_train_batch_size=per_device_batch,
        dataloader_drop_last=False,
    )
    trainer = DFlashTrainer(drafter, args, target=target, train_dataset=samples(count=2))
    trainer.train()
    if trainer.is_world_process_zero():
        save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, out_file)
    finish_launched_worker()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
