"""Drafters grown from a trained one that compute exactly its outputs until trained.

A DFlash2 drafter from a DFlash one (issue 34, part 3: v6 from v5): the DFlash2 parts start at identity, each
convolution's base tap 0 = 1 and everything else 0, the selector's hidden projection 0 (its codebooks random, so the
projection receives gradients); its greedy selector walk is the old greedy chain.

A deeper drafter: decoder layers appended after the last one, fresh but for their two output projections
(`self_attn.o_proj`, `mlp.down_proj`), which start at zero, so each new residual branch adds nothing; the zero
projections receive gradients at once, the rest of the layer as soon as they leave zero.
"""

from __future__ import annotations

import copy

import torch

from ..modeling_dflash import DFlashDraftModel
from ..modeling_dflash.configuration_dflash import DFLASH2_FIELDS


def dflash2_from_dflash(
    drafter: DFlashDraftModel,
    conv_kernel_size: int = 2,
    conv_group_size: int = 16,
    selector_rank: int = 256,
    selector_top_k: int = 16,
) -> DFlashDraftModel:
    """A DFlash2 drafter holding `drafter`'s weights, its DFlash2 parts at identity, on `drafter`'s device
    and dtype (defaults: z-lab's published sizes).

    Raises:
        ValueError: `drafter` is already DFlash2, or the sizes do not fit it (named by the config check).
    """
    if drafter.config.is_dflash2:
        raise ValueError("This drafter is already DFlash2 (config.is_dflash2); nothing to upgrade.")
    config = copy.deepcopy(drafter.config)
    sizes = (conv_kernel_size, conv_group_size, selector_rank, selector_top_k)
    for name, value in zip(DFLASH2_FIELDS, sizes):
        setattr(config, name, value)
    config.validate_dflash()
    upgraded = DFlashDraftModel(config).to(device=drafter.device, dtype=drafter.dtype)
    missing, unexpected = upgraded.load_state_dict(drafter.state_dict(), strict=False)
    new_parts = [key for key in missing if "_conv." in key or key.startswith("candidate_selector.")]
    if unexpected or len(new_parts) != len(missing):
        raise ValueError(
            f"The drafter's weights do not fit a DFlash2 drafter: unexpected {sorted(unexpected)}, "
            f"missing {sorted(set(missing) - set(new_parts))}."
        )
    return upgraded.train(drafter.training)


def deeper_drafter(drafter: DFlashDraftModel, add_layers: int) -> DFlashDraftModel:
    """`drafter` with `add_layers` more decoder layers after its last (each of the last layer's type), the new
    layers' output projections zero, on `drafter`'s device and dtype.

    Raises:
        ValueError: `add_layers` is not a positive integer.
    """
    if isinstance(add_layers, bool) or not isinstance(add_layers, int) or add_layers < 1:
        raise ValueError(f"--add-layers {add_layers!r}: must be a positive integer (the decoder layers to append).")
    config = copy.deepcopy(drafter.config)
    depth = config.num_hidden_layers
    config.num_hidden_layers = depth + add_layers
    config.layer_types = list(config.layer_types) + [config.layer_types[-1]] * add_layers
    grown = DFlashDraftModel(config).to(device=drafter.device, dtype=drafter.dtype)
    missing, unexpected = grown.load_state_dict(drafter.state_dict(), strict=False)
    new_prefixes = tuple(f"layers.{index}." for index in range(depth, depth + add_layers))
    if unexpected or any(not key.startswith(new_prefixes) for key in missing):
        raise ValueError(f"the source drafter's weights do not fit its own config: {unexpected or missing}")
    with torch.no_grad():
        for layer in grown.layers[depth:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return grown.train(drafter.training)


__all__ = ["deeper_drafter", "dflash2_from_dflash"]
