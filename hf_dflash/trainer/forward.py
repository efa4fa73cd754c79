"""The packed training forward: every block of a batch through the drafter at once.

Used by the trainer's loss and by the served-τ estimate (`consistency.py`), so both read the same
drafter outputs.
"""

import torch

from ..modeling_dflash import DFlashConfig
from ..modeling_dflash.modeling_dflash import layer_mask_rule
from .maths import build_training_block_mask, build_training_mask, training_position_ids


def dflash_training_forward(
    drafter: torch.nn.Module,
    embedding: torch.nn.Module,
    batch: dict,
    target_hidden_states: torch.Tensor,
    config: DFlashConfig,
) -> torch.Tensor:
    """Packed multi-block forward: (B, A*bs, H) drafter outputs for every block of the batch at once.

    `drafter` may be wrapped (DDP, PEFT); `config` is its `DFlashConfig` (block size, attention
    implementation: flex attention gets a `BlockMask`, SDPA/eager a dense mask; layer types and windows:
    `training_attention_masks`). target_hidden_states (B, S, n*Ht) are the features of the
    clean sequence; each block sees those strictly before its anchor and its own block
    (see `build_training_mask`).
    """
    seq_len = batch["input_ids"].shape[1]
    return drafter(
        noise_embeds=embedding(batch["block_ids"]),
        context_hidden_states=target_hidden_states,
        position_ids=training_position_ids(batch["block_positions"], seq_len),
        attention_mask=training_attention_masks(config, batch["anchor_positions"], batch["anchor_valid"], seq_len),
    ).last_hidden_state


def training_attention_masks(
    config: DFlashConfig, anchor_positions: torch.LongTensor, anchor_valid: torch.BoolTensor, seq_len: int
):
    """The packed forward's mask for the drafter's layers: one mask when they are all of one type, else
    {layer type: mask}. Each type follows the rule serving masks it with (`layer_mask_rule`: a sliding layer's
    window and block order), so a windowed drafter trains the function it serves."""
    build = build_training_block_mask if config._attn_implementation == "flex_attention" else build_training_mask
    masks = {
        layer_type: build(
            anchor_positions, anchor_valid, seq_len, config.block_size, *layer_mask_rule(config, layer_type)
        )
        for layer_type in sorted(set(config.layer_types))
    }
    return masks if len(masks) > 1 else next(iter(masks.values()))


__all__ = ["dflash_training_forward", "training_attention_masks"]
