"""A DFlash2 drafter that starts as a trained DFlash one (issue 34, part 3: v6 from v5).

The DFlash2 parts start at identity: each convolution's base tap 0 = 1 and everything else 0, the
selector's hidden projection 0 (its codebooks random, so the projection receives gradients). The new
drafter then computes exactly the old one's outputs, and its greedy selector walk is the old greedy chain.
"""

from __future__ import annotations

import copy

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


__all__ = ["dflash2_from_dflash"]
