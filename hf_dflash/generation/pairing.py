"""Checks that a drafter can serve a target, with errors that name the value and the fix."""

from transformers import PreTrainedModel

from ..modeling_dflash import DFlashDraftModel
from ..user_errors import UserTypeError


def check_pairing(target: PreTrainedModel, drafter: DFlashDraftModel) -> None:
    """Raise `ValueError`/`UserTypeError` if `drafter` was not built for `target` or lives elsewhere."""
    if not isinstance(drafter, DFlashDraftModel):
        raise UserTypeError(
            f"Expected a DFlashDraftModel as assistant, got {type(drafter).__name__}: load the drafter with "
            "hf_dflash.load_drafter(...) or AutoModel.from_pretrained(..., trust_remote_code=True)."
        )
    config, text = drafter.config, target.config.get_text_config()
    embedding = target.get_input_embeddings()
    lm_head = target.get_output_embeddings()
    if embedding is None or lm_head is None:
        raise ValueError(
            f"{type(target).__name__} has no input embedding or LM head to lend the drafter; use a *ForCausalLM target."
        )
    if config.target_hidden_size != text.hidden_size:
        raise ValueError(
            f"Drafter expects target hidden size {config.target_hidden_size}, but the target has "
            f"{text.hidden_size}: this drafter was trained for a different target."
        )
    if embedding.weight.shape[1] != config.hidden_size:
        raise ValueError(
            f"Drafter hidden_size {config.hidden_size} differs from the target embedding width "
            f"{embedding.weight.shape[1]}: the drafter consumes the target's embeddings and LM head."
        )
    rows = embedding.weight.shape[0]
    if config.vocab_size != rows or lm_head.weight.shape[0] != rows:
        raise ValueError(
            f"Drafter vocab_size {config.vocab_size} differs from the target's embedding rows {rows} "
            f"(LM head rows {lm_head.weight.shape[0]}): pair the drafter with the target it was built for."
        )
    if not 0 <= config.mask_token_id < rows:
        raise ValueError(f"mask_token_id={config.mask_token_id} is outside the target embedding [0, {rows}).")
    bad = [i for i in config.target_layer_ids if not 0 <= i < text.num_hidden_layers]
    if bad or config.num_target_layers != text.num_hidden_layers:
        raise ValueError(
            f"Drafter target_layer_ids {config.target_layer_ids} (num_target_layers={config.num_target_layers}) "
            f"do not fit a target with {text.num_hidden_layers} decoder layers."
        )
    drafter_param = next(drafter.parameters())
    if drafter_param.device != embedding.weight.device:
        raise ValueError(
            f"Drafter is on {drafter_param.device} but the target embedding is on {embedding.weight.device}; "
            f"call drafter.to({str(embedding.weight.device)!r})."
        )
    if drafter_param.dtype != embedding.weight.dtype:
        raise ValueError(
            f"Drafter dtype {drafter_param.dtype} differs from the target's {embedding.weight.dtype}; "
            f"call drafter.to({embedding.weight.dtype})."
        )
