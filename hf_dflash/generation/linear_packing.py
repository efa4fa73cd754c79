"""Which layers a DFlash `generate` call runs through oneDNN's prepacked linear (`hf_dflash.packed_linears`).

    drafter.linear_packing = "auto"   # default: pack each model whose products it measures faster packed
    drafter.linear_packing = True     # pack whatever can be packed (CPU float32; bfloat16 where oneDNN has a bf16 path)
    drafter.linear_packing = False    # the default aten path

Compiled verification (a static cache with `compile_config`) is packed too: its graph calls the packed product
as one opaque op (`packed_linear`), built with the packs the call made on entry. The packs are laid out for 8 rows
(`PACK_ROWS`, a chain's verification), whatever the width: a pack serves every row count, and one layout per
layer is kept across calls (plain decoding inside `packed_linears(target)` shares it; a pack made for 1 row ran
plain decoding no faster). "auto" packs each model from the fewest rows its timed layer stack pays from
(`packing_floor`: on an Intel Xeon fp32 products of 1-2 rows stay with MKL). The cost model that
sizes trees and hybrid budgets is timed inside the same setting; its cache key says whether the target was packed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext

from transformers import PreTrainedModel

from ..modeling_dflash import DFlashDraftModel
from ..packed_linears import PACK_ROWS, packable_layers, packed_linears, packing_floor


def linear_packing_setting(drafter: DFlashDraftModel):
    """`drafter.linear_packing` ("auto" when unset), checked."""
    setting = getattr(drafter, "linear_packing", "auto")
    if not (setting is True or setting is False or (isinstance(setting, str) and setting == "auto")):
        raise ValueError(
            f"drafter.linear_packing = {setting!r} is not a setting. Use 'auto' (pack where measured faster), "
            "True (pack every CPU float32 linear layer, and bfloat16 where oneDNN multiplies it) or False (the default "
            "matmul)."
        )
    return setting


def loop_linear_packing(target: PreTrainedModel, drafter: DFlashDraftModel) -> AbstractContextManager:
    """The context a DFlash call runs in: its models' linear layers packed, or nothing to do."""
    setting = linear_packing_setting(drafter)
    if setting is False:
        return nullcontext(0)
    floors = {model: 1 if setting is True else packing_floor(model, PACK_ROWS) for model in (target, drafter)}
    if (
        floors[target] is not None and drafter.config.draft_vocab_size is not None
    ):  # the target's head rows it drafts with
        floors[drafter.draft_head(target.get_output_embeddings())] = floors[target]
    return packed_by_floor({model: floor for model, floor in floors.items() if floor is not None})


@contextmanager
def packed_by_floor(floors: dict) -> Iterator[int]:
    """`packed_linears` over each model's layers from its own floor (fewest rows packed); a layer two models share
    is packed once, with the first model's floor. Yields the number of layers packed."""
    seen: set[int] = set()
    groups: dict[int, list] = {}
    for model, floor in floors.items():
        layers = [layer for layer in packable_layers(model) if id(layer) not in seen]
        seen.update(id(layer) for layer in layers)
        groups.setdefault(floor, []).extend(layers)
    with ExitStack() as stack:
        yield sum(
            stack.enter_context(packed_linears(*layers, rows=PACK_ROWS, from_rows=floor))
            for floor, layers in groups.items()
        )
