"""Batches for DFlash training: pad, draw anchors (fresh every step) and lay out the blocks."""

from dataclasses import dataclass

import torch

from .maths import build_blocks, select_anchors


@dataclass
class DFlashDataCollator:
    """Turns samples `{"input_ids", "loss_mask"[, "target_hidden_states"[, "teacher_ids", "teacher_logprobs"]]}`
    into a training batch (cached tensors right-padded with zeros to (B, S, ...)).

    Anchors are drawn here, so every step (and every epoch) sees new blocks of the same data, and the
    Trainer knows the batch's total loss weight before the forward (for exact normalisation over
    gradient accumulation and processes). Sequences are right-padded: a padded position is never
    before an anchor, so it is never visible as context.
    """

    block_size: int
    num_anchors: int
    mask_token_id: int
    gamma: float
    pad_token_id: int = 0
    anchor_decay_tokens: float = 0.0  # `select_anchors`' decay_tokens: 0 draws anchors uniformly
    generator: torch.Generator | None = None

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        lengths = [len(sample["input_ids"]) for sample in samples]
        seq_len = max(lengths)
        input_ids = torch.full((len(samples), seq_len), self.pad_token_id, dtype=torch.long)
        loss_mask = torch.zeros((len(samples), seq_len), dtype=torch.long)
        attention_mask = torch.zeros((len(samples), seq_len), dtype=torch.long)
        for row, (sample, length) in enumerate(zip(samples, lengths)):
            input_ids[row, :length] = torch.as_tensor(sample["input_ids"])
            loss_mask[row, :length] = torch.as_tensor(sample["loss_mask"])
            attention_mask[row, :length] = 1
        anchor_positions, anchor_valid = select_anchors(
            loss_mask, self.num_anchors, self.generator, self.anchor_decay_tokens
        )
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "loss_mask": loss_mask,
            "anchor_positions": anchor_positions,
            "anchor_valid": anchor_valid,
            **build_blocks(
                input_ids, loss_mask, anchor_positions, anchor_valid, self.block_size, self.mask_token_id, self.gamma
            ),
        }
        for name in ("target_hidden_states", "teacher_ids", "teacher_logprobs"):
            if name in samples[0]:
                batch[name] = pad_rows([sample[name] for sample in samples], seq_len)
        return batch


def pad_rows(tensors: list[torch.Tensor], seq_len: int) -> torch.Tensor:
    """(S_i, W) tensors -> (B, seq_len, W), zeros after each."""
    padded = torch.zeros((len(tensors), seq_len, tensors[0].shape[-1]), dtype=tensors[0].dtype)
    for row, tensor in enumerate(tensors):
        padded[row, : tensor.shape[0]] = tensor
    return padded
