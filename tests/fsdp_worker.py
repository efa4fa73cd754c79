"""Worker for the FSDP test: SGD (momentum) steps of DFlashTrainer with checkpoints; losses and the saved drafter's files kept.

Run under `accelerate launch --config_file <FSDP2 config> --num_processes 2` on CPU (gloo) or as a plain single
process. accelerate (1.16) turns FSDP on only on GPU-like devices and runs CPU processes as MULTI_CPU (DDP), so
with FORCE_FSDP2=1 this worker sets the state's distributed type to FSDP once the Trainer has built its
Accelerator: from there on accelerate's own FSDP2 code shards the drafter (`fully_shard`, DTensor parameters,
gloo collectives), gathers it for checkpoints and loads it on resume, as it does on GPUs.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_dflash.trainer import DFlashTrainer  # noqa: E402
from tests.conftest import make_drafter, make_target  # noqa: E402
from tests.helpers.training import BLOCK, arguments, finish_launched_worker, samples  # noqa: E402


class FSDPOnCPUTrainer(DFlashTrainer):
    def create_accelerator_and_postprocess(self) -> None:
        from accelerate.state import AcceleratorState, PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        super().create_accelerator_and_postprocess()
        for state in (PartialState(), AcceleratorState()):
            state.distributed_type = DistributedType.FSDP
        AcceleratorState().fsdp_plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_* variables
        self.is_fsdp_enabled, self.is_fsdp2 = True, True


def main(out_dir: str, per_device_batch: int, max_steps: int, resume: str | None) -> None:
    target = make_target("llama")
    drafter = make_drafter(target, block_size=BLOCK)
    args = arguments(
        Path(out_dir),
        max_steps=max_steps,
        num_anchors=64,  # >= every candidate: the same blocks however the batch is split
        optim="sgd",  # with momentum: resuming must restore the optimizer's state (FSDP: gathered, re-sharded)
        optim_args="momentum=0.9",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        per_device_train_batch_size=per_device_batch,
        dataloader_drop_last=False,
        save_strategy="steps",
        save_steps=1,
    )
    trainer_class = FSDPOnCPUTrainer if os.environ.get("FORCE_FSDP2") == "1" else DFlashTrainer
    trainer = trainer_class(drafter, args, target=target, train_dataset=samples(count=2 * max_steps))
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_drafter(Path(out_dir) / "final")
    if trainer.is_world_process_zero():
        losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
        (Path(out_dir) / "losses.json").write_text(json.dumps(losses))
    finish_launched_worker()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
