"""Model cards: a published drafter's (`template.md` rendered through `huggingface_hub.ModelCard`) and
the short one `save_hub` writes beside any checkpoint (`short_model_card`).

Three inputs fill the published card:
* the drafter's `DFlashConfig` (block size, layers, `target_layer_ids`, `mask_token_id`) and the
  target's Hub id (`base_model`);
* optionally the trainer's `training_record.json` and the latest benchmark JSON (both schemas:
  `hf_dflash.hub_cards.schemas`).

Numbers are written exactly as they appear in the JSON (the benchmark decides their precision);
without a benchmark or record the card says so and shows no numbers.
"""

from __future__ import annotations

import json
import os
from importlib import resources

from huggingface_hub import ModelCard, ModelCardData

from ..modeling_dflash import DFlashConfig
from .schemas import load_benchmark, load_training_record

TAGS = ["dflash", "speculative-decoding", "block-diffusion", "custom_generate"]
# Written into the usage snippets when the repo id is not known yet; `push_folder` replaces it.
REPO_ID_PLACEHOLDER = "your-org/your-dflash-drafter"


def format_number(value: int | float) -> str:
    """A JSON number exactly as JSON writes it (the card shows the benchmark's own digits)."""
    return json.dumps(value)


def _cell(text) -> str:
    """Text safe inside a Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _value(value) -> str:
    """A setting or hyper-parameter: strings as they are, anything else as JSON."""
    return _cell(value if isinstance(value, str) else json.dumps(value))


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    if minutes:
        return f"{minutes} min {secs:02d} s"
    return f"{seconds:.3g} s"


def _count(value: int) -> str:
    for limit, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if value >= limit:
            return f"{value / limit:.2f} {suffix}"
    return str(value)


def _benchmark_context(benchmark: dict) -> dict:
    rows = [
        {
            "name": _cell(name),
            **{key: format_number(row[key]) for key in ("n", "tau", "speedup", "plain_tok_s", "dflash_tok_s")},
            "identical": "yes" if row["identical"] else "no",
        }
        for name, row in benchmark["sets"].items()
    ]
    settings = [(_cell(key), _value(value)) for key, value in benchmark["settings"].items()]
    return {
        "command": benchmark["command"].replace("`", "'"),
        "machine": _cell(benchmark["machine"]),
        "rows": rows,
        "settings": settings,
    }


def _training_context(record: dict) -> dict:
    sources = record["data_sources"]
    return {
        "num_samples": record.get("num_samples", sum(sources.values())),
        "supervised_tokens": record.get("supervised_tokens"),
        "time": _duration(record["training_time_s"]),
        "hardware": record.get("hardware"),
        "global_steps": record.get("global_steps"),
        "init_from": record.get("init_from"),
        "averaged_from": record.get("averaged_from"),
        "sources": [(_cell(name), count) for name, count in sources.items()],
        "hyperparameters": [(_cell(k), _value(v)) for k, v in record["hyperparameters"].items()],
        "final_metrics": [(_cell(k), format_number(v)) for k, v in record.get("final_metrics", {}).items()],
        "derived_settings": [
            (_cell(name), _value(item.get("value")), _cell(f"{item.get('source', '')}: {item.get('reason', '')}"))
            for name, item in record.get("derived_settings", {}).items()
        ],
    }


def attention_description(config: DFlashConfig) -> str:
    """What the drafter's layers attend to, in the words engines differ on: full-attention
    layers are bidirectional inside the block and see all context; sliding-window layers are causal
    inside the block (SpecForge) or bidirectional (`sliding_window_non_causal`), windowed on the context."""
    full = config.layer_types.count("full_attention")
    sliding = config.layer_types.count("sliding_attention")
    parts = []
    if full:
        parts.append(f"{full} full-attention layer{'s' * (full != 1)}: bidirectional inside the block, all context")
    if sliding:
        inside = (
            "bidirectional inside the block (vLLM speculators' semantics, z-lab's `is_causal: false`)"
            if config.sliding_window_non_causal
            else "causal inside the block (SpecForge's semantics)"
        )
        flag = str(config.sliding_window_non_causal).lower()
        parts.append(
            f"{sliding} sliding-window layer{'s' * (sliding != 1)} (window {config.sliding_window}): {inside}, "
            f"windowed on the context; config `sliding_window_non_causal: {flag}`"
        )
    return "; ".join(parts)


def dflash2_description(config: DFlashConfig) -> str | None:
    """What a DFlash2 drafter adds to DFlash, for the card's table (None for a DFlash drafter)."""
    if not config.is_dflash2:
        return None
    return (
        f"two-tap grouped convolutions (kernel {config.conv_kernel_size}, groups of {config.conv_group_size}) around "
        f"both sublayers inside the block; a candidate selector (rank {config.selector_rank}) that re-ranks each "
        f"slot's top-{config.selector_top_k} given the token chosen before it"
    )


def short_model_card(config: DFlashConfig) -> str:
    """The short `README.md` that `save_hub` writes beside a checkpoint (no target, no numbers; a
    published repository gets `render_model_card` instead)."""
    return f"""---
library_name: transformers
tags:
- dflash
- speculative-decoding
- block-diffusion
---

# DFlash drafter

A [DFlash](https://arxiv.org/abs/2602.06036) block-diffusion drafter for speculative decoding. It has
no embedding and no LM head: it borrows the target model's.

| field | value |
|---|---|
| block_size | {config.block_size} |
| target_layer_ids | {list(config.target_layer_ids)} |
| num_target_layers | {config.num_target_layers} |
| mask_token_id | {config.mask_token_id} |
| vocab_size | {config.vocab_size} |

```python
from transformers import AutoModel

drafter = AutoModel.from_pretrained("<this repo>", trust_remote_code=True)
```
"""


# What expanding a pruned draft vocabulary did to acceptance where it was measured (docs/serving.md).
EXPANSION_TAU = (
    "measured on hf-dflash's SmolLM2-135M-Instruct DFlash2 drafter v6 (8,192 draft ids): held-out served τ 3.389 as "
    "trained, 3.455 expanded, on 32 held-out chats in bf16"
)


def render_model_card(
    config: DFlashConfig,
    target_id: str,
    repo_id: str | None = None,
    benchmark: str | os.PathLike | dict | None = None,
    training_record: str | os.PathLike | dict | None = None,
    official: bool = False,
    license: str = "apache-2.0",
    weights_dtype: str = "float32",
    num_parameters: int | None = None,
    official_expanded: bool = False,
) -> ModelCard:
    """The drafter's `ModelCard`: YAML metadata (`base_model`, `library_name`, `tags`, `pipeline_tag`,
    `license`, `datasets`) and the body from `template.md`.

    `repo_id` is the drafter's own Hub id, used in the usage snippets (default: a placeholder that
    `push_folder` fills in). `official` says whether the repo has an `official/` folder, `official_expanded` whether
    that folder holds the drafter expanded to the whole vocabulary (`expand_draft_vocabulary`).
    """
    bench = load_benchmark(benchmark) if benchmark is not None else None
    record = load_training_record(training_record) if training_record is not None else None
    # Hub dataset ids only (the record's `datasets`): its data_sources are this project's own names for the
    # prompts it regenerated, which the Hub would read as dataset ids that do not exist.
    datasets = list(record.get("datasets") or []) or None if record is not None else None
    card_data = ModelCardData(
        base_model=target_id,
        library_name="transformers",
        tags=list(TAGS),
        pipeline_tag="text-generation",
        license=license,
        datasets=datasets,
    )
    template = resources.files(__package__).joinpath("template.md").read_text(encoding="utf-8")
    return ModelCard.from_template(
        card_data,
        template_str=template,
        model_name=f"DFlash drafter for {target_id.split('/')[-1]}",
        target_id=target_id,
        repo_id=repo_id or REPO_ID_PLACEHOLDER,
        local_dir="dflash-drafter",
        official=official,
        block_size=config.block_size,
        num_speculative_tokens=config.block_size - 1,
        num_hidden_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_target_layers=config.num_target_layers,
        target_layer_ids=list(config.target_layer_ids),
        mask_token_id=config.mask_token_id,
        attention=attention_description(config),
        dflash2=dflash2_description(config),
        has_sliding_layers="sliding_attention" in config.layer_types,
        draft_vocab_size=config.draft_vocab_size,
        # DFlash2 with a pruned draft vocabulary has no official layout unless expanded (save_official says why)
        pruned_dflash2=config.is_dflash2 and config.draft_vocab_size is not None,
        official_expanded=official and official_expanded,
        selector_top_k=config.selector_top_k,
        expansion_tau=EXPANSION_TAU,
        num_parameters=_count(num_parameters) if num_parameters is not None else "unknown",
        weights_dtype=weights_dtype,
        benchmark=_benchmark_context(bench) if bench is not None else None,
        training=_training_context(record) if record is not None else None,
    )


__all__ = ["EXPANSION_TAU", "REPO_ID_PLACEHOLDER", "TAGS", "format_number", "render_model_card", "short_model_card"]
