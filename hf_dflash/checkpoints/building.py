"""A `DFlashDraftModel` from translated config kwargs and a state dict: the last step of every loader
that does not go through `from_pretrained` (official, speculators, a drafter object built by other code)."""

from __future__ import annotations

import torch

from ..modeling_dflash import DFlashConfig, DFlashDraftModel
from .files import as_dtype


def shape_fields(key: str, config: DFlashConfig) -> str:
    """The config fields that set the shape of weight `key`, with their values (e.g. "intermediate_size=96,
    hidden_size=32"), or "" for a key this function does not know."""
    c = config
    heads = f"num_attention_heads={c.num_attention_heads} x head_dim={c.head_dim}"
    kv_heads = f"num_key_value_heads={c.num_key_value_heads} x head_dim={c.head_dim}"
    hidden, inner = f"hidden_size={c.hidden_size}", f"intermediate_size={c.intermediate_size}"
    features = f"len(target_layer_ids)={len(c.target_layer_ids)} x target_hidden_size={c.target_hidden_size}"
    by_suffix = {
        "mlp.gate_proj.weight": (inner, hidden),
        "mlp.up_proj.weight": (inner, hidden),
        "mlp.down_proj.weight": (hidden, inner),
        "self_attn.q_proj.weight": (heads, hidden),
        "self_attn.k_proj.weight": (kv_heads, hidden),
        "self_attn.v_proj.weight": (kv_heads, hidden),
        "self_attn.o_proj.weight": (hidden, heads),
        "self_attn.q_norm.weight": (f"head_dim={c.head_dim}",),
        "self_attn.k_norm.weight": (f"head_dim={c.head_dim}",),
        "layernorm.weight": (hidden,),
        "fc.weight": (hidden, features),
        # DFlash2 (docs/dflash2.md)
        "_conv.base_kernel": ("2 (before, after)", f"conv_kernel_size={c.conv_kernel_size}", hidden),
        "_conv.kernel_projection.weight": (
            f"2 x conv_kernel_size={c.conv_kernel_size} x hidden_size / conv_group_size={c.conv_group_size}",
            hidden,
        ),
        "candidate_selector.hidden_projection.weight": (f"selector_rank={c.selector_rank}", hidden),
        "_codebook": (f"vocab_size={c.vocab_size}", f"selector_rank={c.selector_rank}"),
    }
    if key in ("norm.weight", "hidden_norm.weight"):
        return hidden
    for suffix, fields in by_suffix.items():
        if key.endswith(suffix):
            return ", ".join(fields)
    return ""


def shape_mismatch(key: str, found, wanted, config: DFlashConfig | None, where: str) -> str:
    """One line naming the tensor, its shape in the file and the shape (and fields) the config gives."""
    fields = shape_fields(key, config) if config is not None else ""
    return f"{key} is {tuple(found)} in {where} but config.json gives {tuple(wanted)}" + (
        f" ({fields})" if fields else ""
    )


def first_problems(problems: list[str], shown: int = 3) -> str:
    """The first `shown` of `problems`, joined, and how many more there are."""
    more = len(problems) - shown
    return "; ".join(problems[:shown]) + (f"; and {more} more" if more > 0 else "")


def check_state_dict(
    state_dict: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    source: str,
    config: DFlashConfig | None = None,
) -> None:
    """Exact key and shape match against the drafter the config describes (`config`, when given, names the
    fields behind a mismatched shape)."""
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
        shape_mismatch(key, state_dict[key].shape, expected[key].shape, config, "the checkpoint")
        for key in sorted(wanted)
        if tuple(state_dict[key].shape) != tuple(expected[key].shape)
    ]
    if mismatched:
        raise ValueError(
            f"{source}: weight shapes do not match config.json: {first_problems(mismatched)}. The weights and the config "
            "come from different drafters: set config.json to the sizes the weights were trained with."
        )


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
    check_state_dict(state_dict, model.state_dict(), source, config)
    model.load_state_dict(state_dict, strict=True)
    try:
        model.check_draft_vocab()
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None
    if device is not None:
        model = model.to(device)
    return model.eval()


__all__ = ["build_drafter", "check_state_dict", "shape_fields", "shape_mismatch"]
