"""DFlash block-diffusion drafter (arXiv 2602.06036) built from Transformers' Qwen3 pieces.

Self-contained (imports only `torch`, `transformers` and its sibling config): this file is copied
verbatim into Hub repositories as remote code.

The drafter has no embedding and no LM head: it borrows the frozen target's. Each forward takes
  noise_embeds           (B, q, H)   target embeddings of [anchor, MASK x (q-1)]
  context_hidden_states  (B, C, n*Ht) target hidden states h[i+1] for i in target_layer_ids,
                                      concatenated, for the C context tokens not yet in `cache`
and returns `last_hidden_state` (B, q, H); logits = target_lm_head(last_hidden_state).
"""

import torch
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Attention,
    Qwen3DecoderLayer,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)

from .configuration_dflash import DFlashConfig


def apply_rope(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, heads, T, d) states by cos/sin (B, T, d) of their own positions."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return states * cos + rotate_half(states) * sin


def dflash_attention_mask(
    attention_mask: torch.Tensor | None,
    query_length: int,
    key_length: int,
    sliding_window: int | None,
    block_causal: bool = True,
) -> torch.Tensor | None:
    """Boolean (B or 1, 1, q, kv) mask for block queries over [cached context, new context, block] keys.

    Queries are the last `query_length` keys. Full-attention layers (`sliding_window=None`): every
    query sees every non-padding key (the block is bidirectional and sees all context). Sliding
    layers: a key at most `sliding_window - 1` positions before the query; inside the block causal
    (`block_causal`, SpecForge) or bidirectional (`config.sliding_window_non_causal`). Returns None
    when nothing is masked, so SDPA runs unmasked.
    """
    if sliding_window is None:
        if attention_mask is None or bool(attention_mask.all()):
            return None
        return attention_mask[:, None, None, :key_length].bool().expand(-1, 1, query_length, -1)
    device = attention_mask.device if attention_mask is not None else None
    query_index = torch.arange(key_length - query_length, key_length, device=device)[:, None]
    key_index = torch.arange(key_length, device=device)[None, :]
    mask = query_index - key_index < sliding_window  # later keys (only block keys) pass this test
    if block_causal:
        mask = mask & (key_index <= query_index)
    mask = mask[None, None]
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, None, :key_length].bool()
    return mask


class DFlashAttention(Qwen3Attention):
    """Qwen3 attention with KV injection: queries come from the block only, keys and values from
    [context, block] through the same k/v projections; nothing inside the block is causal."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.is_causal = False

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache=None,
        **kwargs,
    ) -> torch.Tensor:
        """hidden_states (B, q, H); context (B, C, H); cos/sin (B, C+q, d) -> (B, q, H)."""
        batch, query_length = hidden_states.shape[:2]
        kv_input = torch.cat([context, hidden_states], dim=1)
        query = self.q_norm(self.q_proj(hidden_states).view(batch, query_length, -1, self.head_dim)).transpose(1, 2)
        key = self.k_norm(self.k_proj(kv_input).view(batch, kv_input.shape[1], -1, self.head_dim)).transpose(1, 2)
        value = self.v_proj(kv_input).view(batch, kv_input.shape[1], -1, self.head_dim).transpose(1, 2)

        cos, sin = position_embeddings
        query = apply_rope(query, cos[:, -query_length:], sin[:, -query_length:])
        key = apply_rope(key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)

        if attention_mask is not None and self.config._attn_implementation == "eager":
            attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~attention_mask, torch.finfo(query.dtype).min
            )
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        output, _ = attention(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            **kwargs,
        )
        return self.o_proj(output.reshape(batch, query_length, -1))


class DFlashDecoderLayer(Qwen3DecoderLayer):
    """Qwen3 pre-norm block whose attention also reads the fused target context."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.self_attn = DFlashAttention(config, layer_idx)

    def forward(self, hidden_states, context, position_embeddings, attention_mask=None, cache=None, **kwargs):
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), context, position_embeddings, attention_mask, cache, **kwargs
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DFlashPreTrainedModel(PreTrainedModel):
    config_class = DFlashConfig
    config: DFlashConfig
    base_model_prefix = ""
    main_input_name = "noise_embeds"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = True  # training: pass the packed mask as a BlockMask
    _supports_attention_backend = True


class DFlashDraftModel(DFlashPreTrainedModel):
    """DFlash drafter: fused target context injected as extra keys/values into every layer."""

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        self.layers = nn.ModuleList([DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.fc = nn.Linear(len(config.target_layer_ids) * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    def fuse_context(self, context_hidden_states: torch.Tensor) -> torch.Tensor:
        """(B, C, n*Ht) concatenated target features -> (B, C, H) fused context."""
        return self.hidden_norm(self.fc(context_hidden_states))

    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_hidden_states: torch.Tensor,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache=None,
        past_key_values=None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """Draft one block.

        noise_embeds (B, q, H); context_hidden_states (B, C, n*Ht);
        position_ids (B, C+q): positions of the new context tokens then of the block
            (default: continue after what `cache` holds);
        attention_mask: 2D (B, past+C+q) padding mask, or a ready boolean 4D (B, 1, q, past+C+q) mask
            (e.g. the packed training mask), or a flex-attention BlockMask, or None;
        cache (`past_key_values` in Transformers <= 5.23): a `DynamicCache`/`DFlashCache` holding the
            context keys/values of earlier rounds; this call appends context AND block keys/values,
            and the caller crops the block before the next round.
        """
        cache = cache if cache is not None else past_key_values
        context = self.fuse_context(context_hidden_states.to(self.fc.weight.dtype))
        query_length, context_length = noise_embeds.shape[1], context.shape[1]
        past_length = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(
                past_length, past_length + context_length + query_length, device=noise_embeds.device
            ).unsqueeze(0)
        key_length = past_length + context_length + query_length

        if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):  # a flex BlockMask
            masks = {layer_type: attention_mask for layer_type in set(self.config.layer_types)}
        elif attention_mask is not None and attention_mask.dim() == 4:
            masks = {layer_type: attention_mask.bool() for layer_type in set(self.config.layer_types)}
        else:
            masks = {
                "full_attention": dflash_attention_mask(attention_mask, query_length, key_length, None),
                "sliding_attention": dflash_attention_mask(
                    attention_mask,
                    query_length,
                    key_length,
                    self.config.sliding_window,
                    block_causal=not self.config.sliding_window_non_causal,
                ),
            }

        hidden_states = noise_embeds.to(self.fc.weight.dtype)
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer, layer_type in zip(self.layers, self.config.layer_types):
            hidden_states = layer(hidden_states, context, position_embeddings, masks[layer_type], cache, **kwargs)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states))

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """`PreTrainedModel.from_pretrained` that refuses checkpoints with missing or unexpected keys
        (Transformers only warns, and a drafter with random layers drafts garbage silently).

        A foreign `config=` (the official layout's `Qwen3Config` with `dflash_config`, which
        `AutoModel.from_pretrained(official_folder, trust_remote_code=True)` passes) is translated."""
        config = kwargs.get("config")
        if isinstance(config, PreTrainedConfig) and not isinstance(config, DFlashConfig):
            kwargs["config"] = DFlashConfig.from_dict(config.to_dict())
        wants_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        problems = {k: sorted(info.get(k) or []) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
        problems = {k: v for k, v in problems.items() if v}
        if problems:
            raise ValueError(
                f"DFlash checkpoint {args[0] if args else ''} does not match DFlashDraftModel: {problems}. "
                "Expected keys layers.{i}.*, norm.weight, fc.weight, hidden_norm.weight (no 'model.' prefix)."
            )
        return (model, info) if wants_info else model


__all__ = ["DFlashDraftModel", "DFlashPreTrainedModel", "dflash_attention_mask"]
