"""Which layers a DFlash `generate` call runs through oneDNN's prepacked linear (`hf_dflash.packed_linears`).

    drafter.linear_packing = "auto"   # default: pack each model whose products it measures faster packed
    drafter.linear_packing = True     # pack whatever can be packed (CPU, float32/bfloat16)
    drafter.linear_packing = False    # the default aten path

Only eager calls are packed: a compiled verification (a static cache with `compile_config`) keeps the graph
inductor built. The packs are laid out for 8 rows (`PACK_ROWS`, a chain's verification), whatever the width: a
pack serves every row count, and one layout per layer is kept across calls (plain decoding inside
`packed_linears(target)` shares it; a pack made for 1 row ran plain decoding no faster). The cost model that
sizes trees and hybrid budgets is timed inside the same setting; its cache key says whether the target was packed.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from transformers import GenerationConfig, PreTrainedModel

from ..modeling_dflash import DFlashDraftModel
from ..packed_linears import PACK_ROWS, packed_linears, packing_pays


def linear_packing_setting(drafter: DFlashDraftModel):
    """`drafter.linear_packing` ("auto" when unset), checked."""
    setting = getattr(drafter, "linear_packing", "auto")
    if not (setting is True or setting is False or (isinstance(setting, str) and setting == "auto")):
        raise ValueError(
            f"drafter.linear_packing = {setting!r} is not a setting. Use 'auto' (pack where measured faster), "
            "True (pack every CPU float32/bfloat16 linear layer) or False (the default matmul)."
        )
    return setting


def loop_linear_packing(
    target: PreTrainedModel, drafter: DFlashDraftModel, generation_config: GenerationConfig, model_kwargs: dict
) -> AbstractContextManager:
    """The context a DFlash call runs in: its models' linear layers packed, or nothing to do."""
    setting = linear_packing_setting(drafter)
    if setting is False or target._valid_auto_compile_criteria(model_kwargs, generation_config):
        return nullcontext(0)
    models = [model for model in (target, drafter) if setting is True or packing_pays(model, PACK_ROWS)]
    if target in models and drafter.config.draft_vocab_size is not None:  # the target's head rows it drafts with
        models.append(drafter.draft_head(target.get_output_embeddings()))
    return packed_linears(*models, rows=PACK_ROWS) if models else nullcontext(0)
