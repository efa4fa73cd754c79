"""A `DFlashDraftModel` from translated config kwargs and a state dict: the last step of every loader
that does not go through `from_pretrained` (official, speculators, a drafter object built by other code)."""

from __future__ import annotations

import torch

from ..modeling_dflash import DFlashConfig, DFlashDraftModel
from .files import as_dtype


def check_state_dict(state_dict: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], source: str) -> None:
    """Exact key and shape match against the drafter the config describes."""
    loaded, wanted = set(state_dict), set(expected)
    if loaded != wanted and any(key.startswith("model.") for key in loaded):
        stripped = {key.removeprefix("model.") for key in loaded}
        fix = (
            "strip the prefix: {k.removeprefix('model.'): v for k, v in state_dict.items()}, then re-save"
            if stripped == wanted
            else "strip the prefix and drop keys that are not drafter weights"
        )
        example = next(key for key in sorted(loaded) if key.startswith("model."))
        raise ValueError(
            f"{source}: weight keys carry a 'model.' prefix (e.g. {example!r}); DFlash keys have none "
            f"(layers.{{i}}.*, norm.weight, fc.weight, hidden_norm.weight): {fix}."
        )
    unexpected, missing = sorted(loaded - wanted), sorted(wanted - loaded)
    if unexpected or missing:
        raise ValueError(
            f"{source}: weights do not match the DFlash drafter described by config.json: "
            f"unexpected keys {unexpected}, missing keys {missing}."
        )
    mismatched = [
        f"{key}: checkpoint {tuple(state_dict[key].shape)} vs config {tuple(expected[key].shape)}"
        for key in sorted(wanted)
        if tuple(state_dict[key].shape) != tuple(expected[key].shape)
    ]
    if mismatched:
        raise ValueError(f"{source}: weight shapes do not match config.json: {'; '.join(mismatched)}.")


def build_drafter(
    kwargs: dict,
    state_dict: dict[str, torch.Tensor],
    source: str,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device | None = None,
    attn_implementation: str | None = None,
) -> DFlashDraftModel:
    """A `DFlashDraftModel` (eval mode) from `DFlashConfig` kwargs and an exactly matching state dict.
    `dtype="auto"` keeps the stored dtype; `source` names the checkpoint in errors."""
    kwargs = dict(kwargs)
    if "target_hidden_size" not in kwargs and isinstance(state_dict.get("fc.weight"), torch.Tensor):
        in_features, num_features = state_dict["fc.weight"].shape[-1], len(kwargs["target_layer_ids"])
        if in_features % num_features == 0:  # older configs omit it; fc's input width tells
            kwargs["target_hidden_size"] = in_features // num_features
    try:
        config = DFlashConfig(**kwargs)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{source}: {error}") from error

    if dtype == "auto" or dtype is None:
        floating = [t.dtype for t in state_dict.values() if t.is_floating_point()]
        resolved = floating[0] if floating else torch.float32
    else:
        resolved = as_dtype(dtype)
    from_config_kwargs = {"dtype": resolved}
    if attn_implementation is not None:
        from_config_kwargs["attn_implementation"] = attn_implementation
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - older Transformers
        from transformers.modeling_utils import no_init_weights
    with no_init_weights():
        model = DFlashDraftModel._from_config(config, **from_config_kwargs)
    check_state_dict(state_dict, model.state_dict(), source)
    model.load_state_dict(state_dict, strict=True)
    try:
        model.check_draft_vocab()
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None
    if device is not None:
        model = model.to(device)
    return model.eval()


__all__ = ["build_drafter", "check_state_dict"]
