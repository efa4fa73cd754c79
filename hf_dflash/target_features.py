"""The target's features for the drafter: the outputs of its `target_layer_ids` layers, concatenated.

Serving reads them from the verification forward (`target_layer_features`); training runs one causal
forward over a whole chat (`compute_target_features`).
"""

import torch
from transformers import PreTrainedModel


def target_layer_features(hidden_states: tuple, target_layer_ids: list[int], rows: int) -> torch.Tensor:
    """(B, rows, n*Ht): outputs of the selected target layers (h[i + 1]) for the first `rows` tokens."""
    return torch.cat([hidden_states[i + 1][:, :rows] for i in target_layer_ids], dim=-1)


@torch.no_grad()
def compute_target_features(
    target: PreTrainedModel,
    input_ids: torch.LongTensor,
    target_layer_ids: list[int],
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """(B, S) token ids -> (B, S, n*Ht): cat(h[i + 1] for i in target_layer_ids) of one causal forward.

    Only the selected layers' hidden states are requested from the target, and its LM head is skipped
    (`logits_to_keep=1` computes a single position).
    """
    outputs = target(
        input_ids=input_ids,
        attention_mask=attention_mask,
        output_hidden_states=[i + 1 for i in target_layer_ids],
        use_cache=False,
        logits_to_keep=1,
    )
    return target_layer_features(outputs.hidden_states, target_layer_ids, input_ids.shape[1])


@torch.no_grad()
def compute_target_features_and_logits(
    target: PreTrainedModel,
    input_ids: torch.LongTensor,
    target_layer_ids: list[int],
    attention_mask: torch.Tensor | None,
    label_positions: torch.LongTensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Features as `compute_target_features`, plus the target's logits (N, V) that PREDICT the tokens at
    `label_positions` (N, 2) = [(row, position)]: its logits at position - 1, from the same forward
    (`logits_to_keep` given the positions, so the LM head runs only where a label needs it)."""
    rows, positions = label_positions[:, 0], label_positions[:, 1] - 1
    kept, index = positions.unique(return_inverse=True)  # sorted positions any row needs
    outputs = target(
        input_ids=input_ids,
        attention_mask=attention_mask,
        output_hidden_states=[i + 1 for i in target_layer_ids],
        use_cache=False,
        logits_to_keep=kept,
    )
    features = target_layer_features(outputs.hidden_states, target_layer_ids, input_ids.shape[1])
    return features, outputs.logits[rows, index]
