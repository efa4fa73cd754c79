"""Configuration of a DFlash block-diffusion drafter.

Self-contained (imports only `transformers`): this file is copied verbatim into Hub repositories as
remote code, next to `modeling_dflash.py`.
"""

from transformers import PreTrainedConfig

LAYER_TYPES = ("full_attention", "sliding_attention")


def default_target_layer_ids(num_target_layers: int, num_target_features: int) -> list[int]:
    """0-based target decoder layers whose outputs the drafter reads.

    One feature: the middle layer. Several: spread evenly from layer 1 to layer L-3, e.g.
    L=36, n=5 -> [1, 9, 17, 25, 33]; L=30 -> [1, 8, 14, 20, 27].
    """
    if num_target_features < 1:
        raise ValueError(f"num_target_features must be >= 1, got {num_target_features}.")
    if num_target_features == 1:
        return [num_target_layers // 2]
    if num_target_layers - 4 < num_target_features - 1:
        raise ValueError(
            f"A target with {num_target_layers} layers is too shallow to spread {num_target_features} "
            "distinct features over layers 1..L-3; pass target_layer_ids explicitly or fewer features."
        )
    step = (num_target_layers - 4) / (num_target_features - 1)
    return [round(1 + i * step) for i in range(num_target_features)]


def choose_mask_token_id(vocab_size: int, tokenizer=None) -> int:
    """Pick an embedding row to use as the MASK token when the caller gives none.

    The mask embedding must not look like real content, so we prefer, in order:
    1. the first embedding row the tokenizer can never produce (Qwen3 pads its embedding past the
       tokenizer: 151669 for a 151669-token tokenizer), when the embedding has such rows;
    2. a special token that is neither BOS/EOS/PAD/UNK nor used by the chat template (e.g.
       SmolLM2's `<repo_name>`), so it never occurs in chat data;
    3. without a tokenizer, the last embedding row: by convention an unused padding row (Qwen) or a
       reserved special token (Llama 3). Pass `tokenizer=` (or `mask_token_id=`) to be sure.
    A real token equal to the mask id would only lower acceptance, never break losslessness.
    """
    if tokenizer is None:
        return vocab_size - 1
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    reserved = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    for token_id in sorted(tokenizer.all_special_ids + list(tokenizer.added_tokens_decoder)):
        token = tokenizer.convert_ids_to_tokens(token_id)
        if token_id not in reserved and token_id < vocab_size and token not in template:
            return token_id
    return vocab_size - 1


class DFlashConfig(PreTrainedConfig):
    r"""Configuration of a [`DFlashDraftModel`].

    Decoder fields follow Qwen3. DFlash fields:
        block_size: tokens drafted per round, including the anchor slot (16 in the paper).
        target_layer_ids: 0-based target decoder layers whose outputs are fused into the context.
        mask_token_id: target embedding row used for the masked block slots.
        num_target_layers: number of decoder layers of the target.
        vocab_size: the target's embedding rows (the drafter borrows its embedding and LM head).
        target_hidden_size: the target's hidden size (defaults to `hidden_size`).
        draft_vocab_size: None (default) drafts over the target's whole vocabulary; N drafts over N
            target token ids only (the `d2t`/`t2d` buffers of the model say which, as in EAGLE-3 and
            vLLM speculators), computing N rows of the target's LM head instead of all of them.
        block_size_policy: the block length per round the drafter's publisher recommends (what hf_dflash's
            loop uses unless `drafter.block_size_policy` is set): None (the trained `block_size`),
            "adaptive" (chosen each round from acceptance and the measured cost of this machine), or a
            fixed k with 2 <= k <= block_size. Other loaders ignore it.

    The defaults describe a 5-layer drafter for Qwen3-8B (36 layers, hidden 4096).
    """

    model_type = "dflash"
    # Serialise every field so the Hub config.json is explicit (no silent defaults for ids).
    has_no_defaults_at_init = True

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 5
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 40960
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_parameters: dict | None = None
    attention_bias: bool = False
    attention_dropout: float | int = 0.0
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    tie_word_embeddings: bool = False
    block_size: int = 16
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = 151669
    num_target_layers: int = 36
    target_hidden_size: int | None = None
    draft_vocab_size: int | None = None
    block_size_policy: str | int | None = None

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.rope_parameters is None and "rope_theta" not in kwargs and "rope_scaling" not in kwargs:
            self.rope_parameters = {"rope_type": "default", "rope_theta": 1_000_000.0}
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if self.target_layer_ids is None:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, 5)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        super().__post_init__(**kwargs)
        self.validate_dflash()

    def validate_dflash(self) -> None:
        """Raise a `ValueError` naming the first inconsistent DFlash field."""
        if not isinstance(self.block_size, int) or self.block_size < 2:
            raise ValueError(f"block_size must be an int >= 2 (anchor + at least one draft), got {self.block_size!r}.")
        ids = self.target_layer_ids
        if not ids:
            raise ValueError("target_layer_ids is empty; give at least one 0-based target layer index.")
        if len(set(ids)) != len(ids):
            raise ValueError(f"target_layer_ids {ids} contains duplicates.")
        bad = [i for i in ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(
                f"target_layer_ids {ids} has {bad} outside [0, num_target_layers={self.num_target_layers}): "
                "ids are 0-based target decoder layers (hidden_states[i + 1])."
            )
        if self.mask_token_id is None:
            raise ValueError(
                "mask_token_id is missing: set it to an unused row of the target's embedding "
                "(see choose_mask_token_id); without it acceptance collapses silently."
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id={self.mask_token_id} is outside the target embedding [0, vocab_size={self.vocab_size})."
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}."
            )
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - set(LAYER_TYPES):
            raise ValueError(
                f"layer_types {self.layer_types} must list one of {LAYER_TYPES} for each of the "
                f"{self.num_hidden_layers} layers."
            )
        if self.draft_vocab_size is not None and (
            not isinstance(self.draft_vocab_size, int) or not 1 <= self.draft_vocab_size <= self.vocab_size
        ):
            raise ValueError(
                f"draft_vocab_size={self.draft_vocab_size!r} must be an int in [1, vocab_size={self.vocab_size}] "
                "(or None for the whole vocabulary)."
            )
        policy = self.block_size_policy
        fixed = isinstance(policy, int) and not isinstance(policy, bool) and 2 <= policy <= self.block_size
        if policy is not None and policy != "adaptive" and not fixed:
            raise ValueError(
                f"block_size_policy={policy!r} must be None (the trained block size), 'adaptive', or an int k "
                f"with 2 <= k <= block_size={self.block_size}."
            )
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set.")

    @classmethod
    def from_target_config(
        cls,
        target_config: PreTrainedConfig,
        num_hidden_layers: int = 5,
        block_size: int = 16,
        num_target_features: int = 5,
        mask_token_id: int | None = None,
        tokenizer=None,
        **overrides,
    ) -> "DFlashConfig":
        """Derive a drafter config from the target's: sizes, heads, RoPE, vocab and default layer ids.

        `tokenizer` (optional) lets `choose_mask_token_id` pick a provably unused mask row.
        `overrides` replace any derived field (e.g. `intermediate_size`, `target_layer_ids`).
        """
        text = target_config.get_text_config()
        rope = dict(getattr(text, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10_000.0})
        if "full_attention" in rope:  # per-layer-type RoPE (Gemma 3): the drafter's layers are global
            rope = dict(rope["full_attention"])
        num_heads = text.num_attention_heads
        fields = {
            "vocab_size": text.vocab_size,
            "hidden_size": text.hidden_size,
            "intermediate_size": text.intermediate_size,
            "num_hidden_layers": num_hidden_layers,
            "num_attention_heads": num_heads,
            "num_key_value_heads": getattr(text, "num_key_value_heads", None) or num_heads,
            "head_dim": getattr(text, "head_dim", None) or text.hidden_size // num_heads,
            "max_position_embeddings": text.max_position_embeddings,
            "rms_norm_eps": getattr(text, "rms_norm_eps", 1e-6),
            "rope_parameters": rope,
            "block_size": block_size,
            "num_target_layers": text.num_hidden_layers,
            "target_hidden_size": text.hidden_size,
            "target_layer_ids": default_target_layer_ids(text.num_hidden_layers, num_target_features),
            "mask_token_id": mask_token_id
            if mask_token_id is not None
            else choose_mask_token_id(text.vocab_size, tokenizer),
        }
        fields.update(overrides)
        return cls(**fields)


__all__ = ["DFlashConfig", "default_target_layer_ids", "choose_mask_token_id"]
