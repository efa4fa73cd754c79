"""Start a drafter from the target's own layers instead of random weights (an A/B lever, PARD-style).

A DFlash draft layer is a Qwen3 pre-norm block; a Llama/Qwen/Mistral target layer has the same
projections and norms (plus, for Qwen3 targets, the per-head q/k norms), so with matching sizes the
draft layers can start as copies of target layers. `init_from_target` copies:
  - draft layer j <- target layer `source_layers[j]` (default: the last N target layers, the ones
    closest to the LM head the drafter writes into): q/k/v/o, gate/up/down, both RMSNorms, and q/k norms
    when the target has them (otherwise they stay 1: per-head RMS normalisation, a change of scale);
  - the drafter's final `norm` <- the target's final norm (its output feeds the target's LM head);
  - `fc` <- the identity on the deepest captured feature (zero on the others), so the fused context
    starts as (the RMS-normalised) hidden state of the deepest target layer it reads.
Shapes must match (`DFlashConfig.from_target_config` makes them match); otherwise a ValueError names
the first mismatch.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["init_from_target"]

LAYER_WEIGHTS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)
OPTIONAL_WEIGHTS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


def target_decoder(target: nn.Module) -> nn.Module:
    """The decoder (the module holding `layers` and `norm`) of a causal LM."""
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else getattr(target, "model", target)
    if not hasattr(decoder, "layers") or not hasattr(decoder, "norm"):
        raise ValueError(f"{type(target).__name__} has no decoder with `layers` and `norm`; cannot copy its layers.")
    return decoder


@torch.no_grad()
def init_from_target(drafter, target, source_layers: list[int] | None = None) -> list[int]:
    """Copy target layers into the draft layers (see the module docstring); returns the source layers used.

    Raises:
        ValueError: a source layer index out of range, a count that differs from the draft layers, or a
            weight whose shape differs between target and drafter.
    """
    decoder = target_decoder(target)
    count, available = len(drafter.layers), len(decoder.layers)
    source_layers = list(range(available - count, available)) if source_layers is None else list(source_layers)
    if len(source_layers) != count or any(not 0 <= i < available for i in source_layers):
        raise ValueError(
            f"source_layers={source_layers} must name {count} target layers (one per draft layer) in [0, {available})."
        )
    for draft_layer, index in zip(drafter.layers, source_layers):
        source = dict(decoder.layers[index].named_parameters())
        mine = dict(draft_layer.named_parameters())
        for name in LAYER_WEIGHTS + tuple(n for n in OPTIONAL_WEIGHTS if n in source):
            if name not in source:
                raise ValueError(
                    f"Target layer {index} has no {name}; init_from_target supports Llama/Qwen-style layers."
                )
            if source[name].shape != mine[name].shape:
                raise ValueError(
                    f"{name}: target layer {index} has shape {tuple(source[name].shape)}, the draft layer "
                    f"{tuple(mine[name].shape)}; build the drafter with DFlashConfig.from_target_config."
                )
            mine[name].copy_(source[name].to(mine[name].dtype))
    drafter.norm.weight.copy_(decoder.norm.weight.to(drafter.norm.weight.dtype))
    hidden = drafter.config.hidden_size
    if drafter.config.target_hidden_size != hidden:
        raise ValueError("init_from_target needs target_hidden_size == hidden_size (fc starts as an identity).")
    deepest = max(range(len(drafter.config.target_layer_ids)), key=lambda i: drafter.config.target_layer_ids[i])
    drafter.fc.weight.zero_()
    drafter.fc.weight[:, deepest * hidden : (deepest + 1) * hidden] = torch.eye(hidden, dtype=drafter.fc.weight.dtype)
    return source_layers
