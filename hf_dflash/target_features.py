"""The target's features for the drafter: the outputs of its `target_layer_ids` layers, concatenated.

Serving reads them from the verification forward (`target_layer_features`); training runs one causal
forward over a whole chat (`compute_target_features`), with the target's logits at label positions for online
distillation (`compute_target_features_and_logits`) or its top-K next-token log-probabilities at every position for
the offline cache (`compute_target_features_and_top_logprobs`).
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


@torch.no_grad()
def compute_target_features_and_top_logprobs(
    target: PreTrainedModel,
    input_ids: torch.LongTensor,
    target_layer_ids: list[int],
    attention_mask: torch.Tensor | None,
    top_k: int,
    chunk_tokens: int = 512,
) -> tuple[torch.Tensor, torch.LongTensor, torch.Tensor]:
    """Features as `compute_target_features`, plus the target's K most likely next tokens at every position.

    Returns (features (B, S, n*Ht), ids (B, S, K) long, log-probabilities (B, S, K) float32, descending): row t
    holds the target's distribution over token t + 1 (a soft teacher for offline distillation). The LM head runs
    `chunk_tokens` positions at a time, so (B, S, V) logits never exist at once. The logits are the model's own:
    the decoder's last hidden state through the LM head, then `final_logit_softcapping` where the config sets
    it, as Gemma's causal-LM forward does.
    """
    if top_k < 1 or top_k > target.config.get_text_config().vocab_size:
        raise ValueError(f"top_k={top_k}: choose between 1 and the target's vocabulary size.")
    outputs = target.get_decoder()(
        input_ids=input_ids,
        attention_mask=attention_mask,
        output_hidden_states=[i + 1 for i in target_layer_ids],
        use_cache=False,
    )
    features = target_layer_features(outputs.hidden_states, target_layer_ids, input_ids.shape[1])
    head, cap = (
        target.get_output_embeddings(),
        getattr(target.config.get_text_config(), "final_logit_softcapping", None),
    )
    ids, logprobs = [], []
    for start in range(0, input_ids.shape[1], chunk_tokens):
        logits = head(outputs.last_hidden_state[:, start : start + chunk_tokens]).float()  # (B, chunk, V)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        top = logits.log_softmax(-1).topk(top_k, dim=-1)
        ids.append(top.indices)
        logprobs.append(top.values)
    return features, torch.cat(ids, 1), torch.cat(logprobs, 1)
