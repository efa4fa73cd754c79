"""DFlash block-diffusion drafter (arXiv 2602.06036) built from Transformers' Qwen3 pieces.

Self-contained (imports only `torch`, `transformers` and its sibling config): this file is copied
verbatim into Hub repositories as remote code.

The drafter has no embedding and no LM head: it borrows the frozen target's. Each forward takes
  noise_embeds           (B, q, H)   target embeddings of [anchor, MASK x (q-1)]
  context_hidden_states  (B, C, n*Ht) target hidden states h[i+1] for i in target_layer_ids,
                                      concatenated, for the C context tokens not yet in `cache`
and returns `last_hidden_state` (B, q, H); logits = `drafter.draft_logits(last_hidden_state, target_lm_head)`
(= target_lm_head(last_hidden_state), or over the draft vocabulary only when `draft_vocab_size` is set).

DFlash2 (`config.is_dflash2`, docs/dflash2.md) adds, as optional parts of the same model, a grouped dynamic
convolution around both sublayers of every layer (`layers.{i}.attention_conv`, `layers.{i}.mlp_conv`) and a
`candidate_selector` that re-ranks the top-K candidates of each slot given the token chosen before it
(`selector_walk`). At identity initialisation both are no-ops: the drafter computes DFlash's outputs.
"""

import json
import os
from pathlib import Path
from typing import NamedTuple

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

from .configuration_dflash import DRAFT_HEAD_FIELD, DRAFT_HEAD_TARGET_ROWS, DFlashConfig


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
    layers: a key at most `sliding_window - 1` tokens before the query; inside the block causal
    (`block_causal`, SpecForge) or bidirectional (`config.sliding_window_non_causal`). A window counts
    tokens, not cache slots: a key's token position is the number of valid slots (`attention_mask`)
    before it, so padding and the holes rejected drafts leave in a batched cache do not shorten it.
    Returns None when nothing is masked, so SDPA runs unmasked.
    """
    if sliding_window is None:
        if attention_mask is None or bool(attention_mask.all()):
            return None
        return attention_mask[:, None, None, :key_length].bool().expand(-1, 1, query_length, -1)
    device = attention_mask.device if attention_mask is not None else None
    key_index = torch.arange(key_length, device=device)
    if attention_mask is None:
        position = key_index[None]  # (1, kv): every slot holds a token
    else:
        position = attention_mask[:, :key_length].long().cumsum(-1) - 1  # (B, kv) token position of each slot
    distance = position[:, -query_length:, None] - position[:, None, :]  # (B or 1, q, kv)
    mask = distance < sliding_window  # later keys (only block keys) pass this test
    if block_causal:
        mask = mask & (key_index[None, :] <= key_index[-query_length:, None])
    mask = mask[:, None]
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, None, :key_length].bool()
    return mask


def layer_mask_rule(config, layer_type: str) -> tuple[int | None, bool]:
    """(window, causal inside the block) of a layer type's attention: full-attention layers see all context and the
    whole block (None, False); sliding-window layers their `sliding_window`, causal unless `sliding_window_non_causal`."""
    if layer_type != "sliding_attention":
        return None, False
    return config.sliding_window, not config.sliding_window_non_causal


def layer_type_masks(config, attention_mask, query_length: int, key_length: int) -> dict:
    """{layer type: the mask its layers attend with} for one drafter forward. `attention_mask` as
    `DFlashDraftModel.forward` takes it: a dict of ready masks per layer type (checked to cover the config's),
    one ready 4D mask or flex BlockMask for every layer, or a 2D padding mask / None from which each layer
    type's mask is built (`dflash_attention_mask` with the type's `layer_mask_rule`)."""
    layer_types = set(config.layer_types)
    if isinstance(attention_mask, dict):  # one ready mask per layer type (training, mixed layer types)
        missing = layer_types - set(attention_mask)
        if missing:
            raise ValueError(f"attention_mask has no mask for the layer types {sorted(missing)}.")
        return attention_mask
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):  # a flex BlockMask
        return {layer_type: attention_mask for layer_type in layer_types}
    if attention_mask is not None and attention_mask.dim() == 4:
        return {layer_type: attention_mask.bool() for layer_type in layer_types}
    return {
        layer_type: dflash_attention_mask(
            attention_mask, query_length, key_length, *layer_mask_rule(config, layer_type)
        )
        for layer_type in layer_types
    }


def grouped_dynamic_conv(
    hidden: torch.Tensor, deltas: torch.Tensor, base_kernel: torch.Tensor, block_size: int
) -> torch.Tensor:
    """DFlash2's causal convolution inside draft blocks, per channel c of group g = c // (H / G):

        out[t, c] = sum_j (base_kernel[j, c] + deltas[t, j, g]) * hidden[t - j, c]

    hidden (B, q, H): the q positions are consecutive blocks of `block_size` (the last may be shorter) and
    hidden[t - j] is zero when t - j lies in an earlier block (nothing crosses a block boundary);
    deltas (B, q, taps, G): per-position kernel offsets; base_kernel (taps, H). Returns (B, q, H).
    """
    batch, length, size = hidden.shape
    taps, groups = deltas.shape[-2:]
    grouped = hidden.view(batch, length, groups, size // groups)
    kernel = base_kernel.to(hidden.dtype).view(taps, groups, -1) + deltas.to(hidden.dtype).unsqueeze(-1)
    output = kernel[:, :, 0] * grouped
    offset_in_block = torch.arange(length, device=hidden.device) % block_size
    for tap in range(1, taps):
        earlier = nn.functional.pad(grouped[:, : length - tap], (0, 0, 0, 0, tap, 0))  # hidden[t - tap]
        inside = (offset_in_block >= tap).view(1, length, 1, 1)
        output = output + torch.where(inside, kernel[:, :, tap] * earlier, 0.0)
    return output.view_as(hidden)


class DFlashGroupedConv(nn.Module):
    """DFlash2's convolution around one sublayer (attention or MLP) of a draft layer, over the block only.

    base_kernel (2, taps, H): [0] convolves the sublayer's input, [1] its output. kernel_projection
    (H -> 2 * taps * G, G = H / group_size) reads the sublayer's (normed) input and gives both sides'
    per-position deltas. Identity (`reset_to_identity`): base tap 0 = 1, all else 0. The block size is an
    argument of every call, read from the drafter's config: nothing here keeps it, so a drafter trained further at
    another block size (its `config.block_size` changed) convolves within the blocks its config states.
    """

    def __init__(self, hidden_size: int, taps: int, group_size: int):
        super().__init__()
        self.taps, self.groups = taps, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)

    def before(self, hidden: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, q, H) sublayer input, q in blocks of `block_size` -> (its convolution, the (B, q, taps, G) deltas
        for `after`)."""
        deltas = self.kernel_projection(hidden).view(*hidden.shape[:-1], 2, self.taps, self.groups)
        convolved = grouped_dynamic_conv(hidden, deltas[..., 0, :, :], self.base_kernel[0], block_size)
        return convolved, deltas[..., 1, :, :]

    def after(self, output: torch.Tensor, deltas: torch.Tensor, block_size: int) -> torch.Tensor:
        """(B, q, H) sublayer output -> its convolution with the deltas `before` computed."""
        return grouped_dynamic_conv(output, deltas, self.base_kernel[1], block_size)

    @torch.no_grad()
    def reset_to_identity(self) -> None:
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()


class SelectorPath(NamedTuple):
    """A walk of the candidate selector over L slots: tokens (..., L) chosen, choices (..., L) their index among
    the K candidates, scores (..., L, K) the scores S each slot's choice was made from."""

    tokens: torch.LongTensor
    choices: torch.LongTensor
    scores: torch.Tensor


def greedy_choice(scores: torch.Tensor) -> torch.LongTensor:
    """(..., K) -> (...) index of the highest score (the first on ties)."""
    return scores.argmax(-1)


def selector_walk(
    candidate_ids: torch.LongTensor,
    unary_logits: torch.Tensor,
    projected_hidden: torch.Tensor,
    predecessor_codebook: torch.Tensor,
    successor_codebook: torch.Tensor,
    anchor_ids: torch.LongTensor,
    choose=greedy_choice,
) -> SelectorPath:
    """DFlash2's walk over a block: slot l picks among its K candidates with scores

        S_l[k] = unary_logits[l, k] + < A[pred_l] * P[l], B[candidate_ids[l, k]] >

    where A/B are the predecessor/successor codebooks (V, r), P = projected_hidden (..., L, r) (the selector's
    hidden projection of the drafter's outputs), pred_1 = the anchor and pred_{l+1} = the token chosen at l.
    candidate_ids, unary_logits (..., L, K); anchor_ids (...). `choose` maps (..., K) scores to an index
    (default greedy: the argmax). With P = 0 the walk takes each slot's best unary candidate.
    """
    successors = successor_codebook[candidate_ids].float()  # (..., L, K, r)
    predecessor = anchor_ids
    tokens, choices, rows = [], [], []
    for slot in range(candidate_ids.shape[-2]):
        context = predecessor_codebook[predecessor].float() * projected_hidden[..., slot, :].float()  # (..., r)
        scores = unary_logits[..., slot, :].float() + (successors[..., slot, :, :] @ context.unsqueeze(-1)).squeeze(-1)
        choice = choose(scores)
        predecessor = candidate_ids[..., slot, :].gather(-1, choice.unsqueeze(-1)).squeeze(-1)
        tokens.append(predecessor)
        choices.append(choice)
        rows.append(scores)
    return SelectorPath(torch.stack(tokens, -1), torch.stack(choices, -1), torch.stack(rows, -2))


def unary_top_k(logits: torch.Tensor, k: int) -> tuple[torch.LongTensor, torch.Tensor]:
    """(..., V) draft logits -> the K best (ids, logits), each (..., K), best first and equal logits by
    ascending id, so candidate 0 is the argmax (first on ties) whenever the top logit is unique within K."""
    values, ids = logits.topk(k, dim=-1)
    ids, order = ids.sort(-1)
    values, order = values.gather(-1, order).sort(dim=-1, descending=True, stable=True)
    return ids.gather(-1, order), values


class DFlashCandidateSelector(nn.Module):
    """DFlash2's candidate selector: codebooks `predecessor_codebook`, `successor_codebook` (V, r), stored
    under these bare names, and `hidden_projection` (H -> r). Identity (`reset_to_identity`): projection 0,
    so every score is the unary logit (the codebooks stay random, so training moves the projection)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def walk(self, hidden, logits, anchor_ids, choose=greedy_choice, temperature: float = 1.0, token_ids=None):
        """`selector_walk` over the top-K of the draft logits (..., L, V) (processed, if the loop processes them)
        of the drafter's outputs hidden (..., L, H) at the block's L draft slots, from anchor_ids (...); the pair
        term is divided by `temperature` (sampling at T: softmax(S / T), the unary logits already tempered).
        token_ids (V',): the target ids of logits over a pruned draft vocabulary's V' columns (None: V' = V).
        Returns (the SelectorPath, the candidate target ids (..., L, K) its score rows refer to)."""
        candidate_ids, unary = unary_top_k(logits.float(), self.top_k)
        if token_ids is not None:
            candidate_ids = token_ids.to(candidate_ids.device)[candidate_ids]
        projected = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype)) / temperature
        codebooks = self.predecessor_codebook, self.successor_codebook
        return selector_walk(candidate_ids, unary, projected, *codebooks, anchor_ids, choose), candidate_ids

    @torch.no_grad()
    def reset_to_identity(self, std: float = 1.0) -> None:
        """Projection 0: every score is the unary logit, whatever the codebooks hold. They are drawn with unit
        std so that the pair term reaches the logits' scale as fast as Adam moves the projection (by ~lr a
        step): drawn at 0.02, as other weights, the selector of the v6 pilot had not moved off the unary
        ranking after 100 steps at lr 2e-4."""
        self.predecessor_codebook.normal_(0.0, std)
        self.successor_codebook.normal_(0.0, std)
        self.hidden_projection.weight.zero_()


def transform_logits(logits: torch.Tensor, multiplier: float, softcap: float | None) -> torch.Tensor:
    """z-lab's output transforms: logits * multiplier, then softcap * tanh(logits / softcap) (None: no cap)."""
    if multiplier != 1.0:
        logits = logits * multiplier
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


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
            if isinstance(attention_mask, torch.Tensor) and attention_mask.shape[-1] > key.shape[-2]:
                # a sliding-window cache layer returns only the keys its window still needs (the last ones)
                attention_mask = attention_mask[..., -key.shape[-2] :]

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
        self.attention_conv = self.mlp_conv = None
        if config.is_dflash2:  # DFlash2: a grouped dynamic convolution around each sublayer (block only)
            sizes = (config.hidden_size, config.conv_kernel_size, config.conv_group_size)
            self.attention_conv, self.mlp_conv = DFlashGroupedConv(*sizes), DFlashGroupedConv(*sizes)

    def forward(self, hidden_states, context, position_embeddings, attention_mask=None, cache=None, **kwargs):
        """hidden_states (B, q, H) the block(s); context (B, C, H) the fused target context (never convolved)."""
        normed = self.input_layernorm(hidden_states)
        block_size = self.self_attn.config.block_size  # the drafter's config (training may change it)
        if self.attention_conv is not None:
            normed, deltas = self.attention_conv.before(normed, block_size)
        attended = self.self_attn(normed, context, position_embeddings, attention_mask, cache, **kwargs)
        if self.attention_conv is not None:
            attended = self.attention_conv.after(attended, deltas, block_size)
        hidden_states = hidden_states + attended
        normed = self.post_attention_layernorm(hidden_states)
        if self.mlp_conv is not None:
            normed, deltas = self.mlp_conv.before(normed, block_size)
        transformed = self.mlp(normed)
        if self.mlp_conv is not None:
            transformed = self.mlp_conv.after(transformed, deltas, block_size)
        return hidden_states + transformed


def mismatch_line(entry) -> str:
    """'key is (found) in the weights but config.json gives (expected)' for one of Transformers' mismatched keys
    ((key, checkpoint shape, model shape) in 5.25; the bare entry otherwise)."""
    if isinstance(entry, (tuple, list)) and len(entry) == 3:
        key, found, expected = entry
        return f"{key} is {tuple(found)} in the weights but config.json gives {tuple(expected)}"
    return str(entry)


def check_loading_info(info: dict, source, config: DFlashConfig) -> None:
    """ValueError for a checkpoint whose weights Transformers' loading info (`output_loading_info=True`) reports
    mismatched (named with both shapes), missing or unexpected: Transformers only warns about the last two, and a
    drafter with random layers drafts garbage silently."""
    if info.get("mismatched_keys"):
        raise ValueError(
            f"DFlash checkpoint {source}: weight shapes do not match its config.json: "
            + "; ".join(mismatch_line(entry) for entry in sorted(info["mismatched_keys"], key=str))
            + ". The weights and the config come from different drafters: set config.json to the sizes the "
            "weights were trained with."
        )
    problems = {k: sorted(info.get(k) or []) for k in ("missing_keys", "unexpected_keys")}
    allow_target_head_rows(problems["unexpected_keys"], config, source)
    problems = {k: v for k, v in problems.items() if v}
    if problems:
        raise ValueError(
            f"DFlash checkpoint {source} does not match DFlashDraftModel: {problems}. "
            "Expected keys layers.{i}.*, norm.weight, fc.weight, hidden_norm.weight (no 'model.' prefix)"
            + (", candidate_selector.* (DFlash2)" if config.is_dflash2 else "")
            + (", d2t, t2d (draft_vocab_size is set)." if config.draft_vocab_size is not None else ".")
        )


def safetensors_problem(file: Path) -> str | None:
    """Why the safetensors `file` is truncated or corrupt (its 8-byte header length, JSON header and the data
    its tensors' offsets need, checked without reading the data), or None."""
    size = file.stat().st_size
    with open(file, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            return f"{size} bytes, shorter than the 8-byte header length"
        header_length = int.from_bytes(prefix, "little")
        if size < 8 + header_length:
            return f"its header says {header_length} bytes but the file has {size} bytes in all"
        try:
            header = json.loads(handle.read(header_length))
        except ValueError:
            return "its header is not valid JSON"
    ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    needed = 8 + header_length + max(ends, default=0)
    return None if size >= needed else f"its tensors end at byte {needed} but the file has {size} bytes"


def check_local_weight_files(folder) -> None:
    """ValueError naming a truncated or corrupt `*.safetensors` file of a local checkpoint folder (a Hub repo id
    is left to `from_pretrained`)."""
    if not isinstance(folder, (str, os.PathLike)) or not os.path.isdir(folder):
        return
    for file in sorted(Path(folder).glob("*.safetensors")):
        problem = safetensors_problem(file)
        if problem is not None:
            raise ValueError(f"{file} is a truncated or corrupt weights file: {problem}. Copy or download it again.")


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

    def get_input_embeddings(self) -> None:
        """None: the drafter embeds with the target's embedding (`noise_embeds`) and has none of its own.
        Transformers' default raises instead, and callers such as accelerate's FSDP2 wrapping ask for it."""
        return None

    def _init_weights(self, module):
        """Transformers' initialisation, and DFlash2's parts at identity (the model then computes DFlash's
        outputs) unless a checkpoint already filled them."""
        super()._init_weights(module)
        if isinstance(module, DFlashGroupedConv) and not _loaded(module):
            module.reset_to_identity()
        elif isinstance(module, DFlashCandidateSelector) and not _loaded(module):
            module.reset_to_identity()


def _loaded(module: nn.Module) -> bool:
    """Whether Transformers' loading filled some of the module's parameters from a checkpoint."""
    return any(getattr(parameter, "_is_hf_initialized", False) for parameter in module.parameters())


# What plain assisted decoding is told when it reaches for an autoregressive assistant's generation config.
NOT_AN_ASSISTANT = (
    "DFlashDraftModel is a block-diffusion drafter, not an autoregressive assistant_model: plain assisted decoding "
    "cannot run it (it has no generation_config). Use generate(..., assistant_model=drafter, "
    "speculation_type='dflash') (Transformers' own DFlash loop), generate(..., custom_generate=<this drafter's "
    "folder or Hub repo>, trust_remote_code=True) (the loop the drafter ships), or `import hf_dflash` first (then "
    "generate(..., assistant_model=drafter) runs the hf-dflash loop)."
)


@torch.no_grad()
def head_rows(lm_head: nn.Module, ids: torch.LongTensor) -> nn.Linear:
    """A frozen Linear holding rows `ids` (N,) of `lm_head` (and of its bias): logits over those ids only."""
    weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
    ids = ids.to(weight.device)
    head = nn.utils.skip_init(
        nn.Linear, weight.shape[1], len(ids), bias=bias is not None, device=weight.device, dtype=weight.dtype
    ).requires_grad_(False)
    head.weight.copy_(weight.index_select(0, ids))
    if bias is not None:
        head.bias.copy_(bias[ids])
    return head


def head_product(head: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """`head(hidden_states)` (..., H) -> (..., V) over rows flattened to 2-D first (the head may be bf16 under an
    fp32 drafter): a 3-D slice such as `hidden[:, 1:]` of a (1, k, H) block made aten's matmul (torch 2.13, CPU)
    take its batched path, which expands and copies the whole head's weight on every call (8,192 rows: 5.2 ms
    instead of 0.5)."""
    logits = head(hidden_states.to(head.weight.dtype).reshape(-1, hidden_states.shape[-1]))
    return logits.view(*hidden_states.shape[:-1], logits.shape[-1])


def allow_target_head_rows(unexpected_keys: list[str], config: DFlashConfig, source) -> None:
    """An official folder of a pruned-vocabulary drafter holds `lm_head.weight` (draft_vocab_size, H), the target
    head's rows that vLLM loads; the drafter borrows them from the target, so the key is dropped from
    `unexpected_keys`, but only where the config marks it so (its mark is taken off the config here)."""
    draft_head = config.__dict__.pop(DRAFT_HEAD_FIELD, None)  # an official config's mark, not a setting
    if "lm_head.weight" not in unexpected_keys or config.draft_vocab_size is None:
        return
    if draft_head != DRAFT_HEAD_TARGET_ROWS:
        raise ValueError(
            f'DFlash checkpoint {source} holds lm_head.weight without {DRAFT_HEAD_FIELD}: "{DRAFT_HEAD_TARGET_ROWS}" '
            "in its config: a draft head of its own, while this drafter drafts with the target head's rows."
        )
    unexpected_keys.remove("lm_head.weight")


class DFlashDraftModel(DFlashPreTrainedModel):
    """DFlash drafter: fused target context injected as extra keys/values into every layer."""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "generation_config":  # still an AttributeError: hasattr() stays False, as for any drafter
                raise AttributeError(NOT_AN_ASSISTANT) from None
            raise

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        self.layers = nn.ModuleList([DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.fc = nn.Linear(len(config.target_layer_ids) * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.candidate_selector = None
        if config.is_dflash2:
            self.candidate_selector = DFlashCandidateSelector(
                config.hidden_size, config.vocab_size, config.selector_rank, config.selector_top_k
            )
        if config.draft_vocab_size is not None:
            # EAGLE-3 / vLLM speculators convention: draft index i is target id i + d2t[i]; t2d marks the ids.
            # Until `set_draft_vocab` is called the draft vocabulary is the first draft_vocab_size ids.
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
            t2d[: config.draft_vocab_size] = True
            self.register_buffer("t2d", t2d)
        self._draft_head = None  # (key, nn.Linear of the target LM head's rows for the draft vocabulary)
        self.post_init()

    @property
    def draft_token_ids(self) -> torch.LongTensor | None:
        """(N,) target ids of the draft vocabulary, ascending; None when drafting over the whole vocabulary."""
        if self.config.draft_vocab_size is None:
            return None
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    @torch.no_grad()
    def set_draft_vocab(self, token_ids) -> None:
        """Draft over these target token ids only (any order; stored ascending as `d2t`/`t2d`).

        Raises:
            ValueError: not `config.draft_vocab_size` distinct ids in [0, vocab_size).
        """
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().unique()  # sorted
        size, vocab = self.config.draft_vocab_size, self.config.vocab_size
        if size is None:
            raise ValueError(
                "This drafter has draft_vocab_size=None (whole vocabulary); build it with draft_vocab_size=N."
            )
        if len(ids) != torch.as_tensor(token_ids).numel() or len(ids) != size:
            raise ValueError(
                f"set_draft_vocab needs {size} distinct token ids (draft_vocab_size), got {torch.as_tensor(token_ids).numel()} ({len(ids)} distinct)."
            )
        if ids[0] < 0 or ids[-1] >= vocab:
            raise ValueError(
                f"Draft vocabulary ids must lie in [0, vocab_size={vocab}); got {int(ids[0])}..{int(ids[-1])}."
            )
        self.d2t.copy_(ids.to(self.d2t.device) - torch.arange(size, device=self.d2t.device))
        self.t2d.zero_()
        self.t2d[ids.to(self.t2d.device)] = True
        self._draft_head = None

    def check_draft_vocab(self) -> None:
        """ValueError unless `d2t`/`t2d` describe the same `draft_vocab_size` distinct ids of the vocabulary
        (a corrupt or foreign checkpoint)."""
        if self.config.draft_vocab_size is None:
            return
        ids = self.draft_token_ids
        vocab = self.config.vocab_size
        if bool((ids < 0).any()) or bool((ids >= vocab).any()):
            raise ValueError(f"The draft vocabulary (d2t) maps outside the target vocabulary [0, {vocab}).")
        if len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("The draft vocabulary (d2t) is not strictly ascending: ids repeat or are out of order.")
        if int(self.t2d.sum()) != len(ids) or not bool(self.t2d[ids].all()):
            raise ValueError("The draft vocabulary buffers disagree: t2d does not mark exactly the ids of d2t.")

    def draft_head(self, lm_head: nn.Module) -> nn.Linear:
        """The rows of the target's LM head for the draft vocabulary, as a Linear (H -> N) gathered once, then
        reused while the head's weight is unchanged. Not a submodule: it is never saved, and it is a plain Linear
        that CPU backends may run their own way (`hf_dflash.packed_linears`)."""
        weight = lm_head.weight
        key = (weight.data_ptr(), weight._version, weight.dtype, weight.device, self.d2t.data_ptr(), self.d2t._version)
        if self._draft_head is None or self._draft_head[0] != key:
            self._draft_head = (key, head_rows(lm_head, self.draft_token_ids))  # a tuple: not a submodule
        return self._draft_head[1]

    def greedy_draft_tokens(self, hidden_states: torch.Tensor, lm_head: nn.Module) -> torch.LongTensor:
        """(...) target ids of the argmax drafts (first index on ties), without building full-vocabulary logits."""
        logits = self.draft_logits(hidden_states, lm_head, full_vocab=False)
        best = logits.max(-1).indices
        return best if self.config.draft_vocab_size is None else self.draft_token_ids.to(best.device)[best]

    def draft_logits(self, hidden_states: torch.Tensor, lm_head: nn.Module, full_vocab: bool = True) -> torch.Tensor:
        """Logits of the drafter's outputs (..., H) through the target's LM head.

        Without a draft vocabulary: `lm_head(hidden_states)` (..., V). With one: only its N rows are
        computed; `full_vocab=True` scatters them into (..., V) with -inf elsewhere (a proposal that
        never drafts other ids: greedy and rejection sampling stay lossless), False returns (..., N).
        The config's `output_multiplier` and `final_logit_softcapping` apply (no-ops by default).
        """
        config = self.config
        head = lm_head if config.draft_vocab_size is None else self.draft_head(lm_head)
        logits = head_product(head, hidden_states)
        logits = transform_logits(logits, config.output_multiplier, config.final_logit_softcapping)
        if config.draft_vocab_size is None or not full_vocab:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.draft_token_ids.to(logits.device), logits)

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
            (e.g. the packed training mask), or a flex-attention BlockMask, or a dict of ready masks keyed
            by layer type ("full_attention", "sliding_attention"), or None;
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

        masks = layer_type_masks(self.config, attention_mask, query_length, key_length)

        hidden_states = noise_embeds.to(self.fc.weight.dtype)
        if self.config.input_embedding_scale != 1.0:
            hidden_states = hidden_states * self.config.input_embedding_scale
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer, layer_type in zip(self.layers, self.config.layer_types):
            hidden_states = layer(hidden_states, context, position_embeddings, masks[layer_type], cache, **kwargs)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states))

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """`PreTrainedModel.from_pretrained` that refuses checkpoints with missing or unexpected keys
        (Transformers only warns, and a drafter with random layers drafts garbage silently), names each tensor
        whose shape differs from the config's and a truncated or corrupt weights file.

        A foreign `config=` (the official layout's `Qwen3Config` with `dflash_config`, which
        `AutoModel.from_pretrained(official_folder, trust_remote_code=True)` passes) is translated."""
        config = kwargs.get("config")
        if isinstance(config, PreTrainedConfig) and not isinstance(config, DFlashConfig):
            kwargs["config"] = DFlashConfig.from_dict(config.to_dict())
        wants_info = kwargs.pop("output_loading_info", False)
        source = args[0] if args else kwargs.get("pretrained_model_name_or_path", "")
        check_local_weight_files(source)
        kwargs["ignore_mismatched_sizes"] = True  # refused below by name (Transformers 5.25: a bare RuntimeError)
        try:
            model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        except Exception as error:  # safetensors' SafetensorError, by name: remote code imports torch/transformers
            if type(error).__name__ != "SafetensorError":
                raise
            raise ValueError(
                f"DFlash checkpoint {source}: a truncated or corrupt weights file ({error}); copy or download it again."
            ) from error
        check_loading_info(info, source, model.config)
        model.check_draft_vocab()
        return (model, info) if wants_info else model


__all__ = [
    "DFlashCandidateSelector",
    "DFlashDraftModel",
    "DFlashGroupedConv",
    "DFlashPreTrainedModel",
    "SelectorPath",
    "dflash_attention_mask",
    "grouped_dynamic_conv",
    "selector_walk",
    "transform_logits",
    "unary_top_k",
]
