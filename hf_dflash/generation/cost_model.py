"""The cost model of the adaptive block size: seconds of one DFlash round per block length k and batch rows.

A round = drafter pass(k) + target verification pass(k). It is timed with the real models at a few k
(1, 2, 4, 8, 16 up to the drafter's block size B), once per (target config, drafter config, device,
dtypes, torch version, torch threads), and cached as JSON under `<hf_dflash cache>/cost_models/`
(written atomically; a corrupt file is measured again with a warning). Other k and row counts are
interpolated.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DFlashCache, DynamicCache

from ..json_files import write_json_atomic
from ..modeling_dflash import DFlashDraftModel

logger = logging.getLogger(__name__)

COST_MODEL_FORMAT = 1
MEASURED_BLOCK_LENGTHS = (1, 2, 4, 8, 16)


def interpolate(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise-linear y(x) through the points (xs increasing), extended linearly past both ends."""
    if len(xs) == 1:
        return float(ys[0])
    right = next((i for i in range(1, len(xs)) if x <= xs[i]), len(xs) - 1)
    x0, x1, y0, y1 = xs[right - 1], xs[right], ys[right - 1], ys[right]
    return float(y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class CostModel:
    """Seconds of one round (drafter pass + target verification) per block length k and batch rows.

    block_lengths: the measured k, increasing, starting at 1 (k = 1: verification only, no drafter);
    seconds: rows -> seconds at each of `block_lengths`. Other k are interpolated linearly (extended
    past the last measured k); other row counts linearly between measured ones, proportionally above
    the largest and as the smallest below it.
    """

    block_lengths: tuple[int, ...]
    seconds: dict[int, tuple[float, ...]]

    def __post_init__(self):
        lengths = tuple(self.block_lengths)
        if not lengths or lengths[0] != 1 or any(b <= a for a, b in zip(lengths, lengths[1:])):
            raise ValueError(f"CostModel.block_lengths must increase from 1, got {self.block_lengths!r}.")
        if not self.seconds:
            raise ValueError("CostModel.seconds is empty; give {rows: seconds per block length}.")
        for rows, values in self.seconds.items():
            if not isinstance(rows, int) or rows < 1:
                raise ValueError(f"CostModel.seconds keys are row counts >= 1, got {rows!r}.")
            if len(values) != len(lengths) or not all(value > 0 for value in values):
                raise ValueError(
                    f"CostModel.seconds[{rows}] = {values!r} must hold {len(lengths)} positive seconds "
                    f"(one per block length {lengths})."
                )
        object.__setattr__(self, "block_lengths", lengths)
        object.__setattr__(self, "seconds", {rows: tuple(map(float, v)) for rows, v in sorted(self.seconds.items())})

    @classmethod
    def from_function(cls, seconds: Callable[[int], float], max_block_size: int) -> "CostModel":
        """A batch-1 model from `seconds(k)` at k = 1..max_block_size (synthetic models in tests)."""
        lengths = tuple(range(1, max_block_size + 1))
        return cls(lengths, {1: tuple(seconds(k) for k in lengths)})

    def round_seconds(self, rows: int, max_block_size: int) -> torch.Tensor:
        """(max_block_size,) float64: seconds of a round with block length k = 1..max_block_size."""
        measured = sorted(self.seconds)
        scale = 1.0
        if rows >= measured[-1]:
            scale, per_length = rows / measured[-1], self.seconds[measured[-1]]
        elif rows <= measured[0]:
            per_length = self.seconds[measured[0]]
        else:
            per_length = [interpolate(rows, measured, [self.seconds[r][i] for r in measured])
                          for i in range(len(self.block_lengths))]
        values = [scale * interpolate(k, self.block_lengths, per_length) for k in range(1, max_block_size + 1)]
        if min(values) <= 0:
            raise ValueError(f"The cost model extrapolates to non-positive seconds {values} for {rows} rows.")
        return torch.tensor(values, dtype=torch.float64)

    def to_dict(self) -> dict:
        return {"block_lengths": list(self.block_lengths), "seconds": {str(r): list(v) for r, v in self.seconds.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> "CostModel":
        """Inverse of `to_dict`; ValueError (or KeyError/TypeError) on a malformed dict."""
        return cls(tuple(data["block_lengths"]), {int(r): tuple(v) for r, v in data["seconds"].items()})


def measured_block_lengths(block_size: int) -> tuple[int, ...]:
    """The k timed for a drafter of block size B: 1, 2, 4, 8, 16 up to B, and B."""
    return tuple(sorted({k for k in MEASURED_BLOCK_LENGTHS if k <= block_size} | {block_size}))


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


@torch.no_grad()
def measure_round_seconds(
    target: PreTrainedModel,
    drafter: DFlashDraftModel,
    rows: int,
    block_lengths: Sequence[int],
    context_length: int = 32,
    repeats: int = 3,
) -> tuple[float, ...]:
    """Median seconds of one round per block length k, timed with the real models.

    A round = drafter pass over k new context features and a k-token block, its LM head on the k-1 draft
    slots (none when k = 1), then a target forward over k tokens after a `context_length`-token prompt,
    with the hidden states the drafter needs. Both caches are cropped back after each pass. The block
    lengths are timed in turn `repeats` times (machine noise spreads over all of them) after one
    warm-up round; a round never gets cheaper with k, so noise that says otherwise is evened out
    (running maximum). Uses no random numbers, so measuring never changes what `generate` samples.
    """
    device = target.device
    layer_ids = list(drafter.config.target_layer_ids)
    hidden_request = [i + 1 for i in layer_ids]
    embedding, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    context_length = max(context_length, max(block_lengths))
    token_ids = (torch.arange(rows * context_length, device=device) * 7919 % embedding.num_embeddings).view(rows, -1)
    # Transformers 5.24 names the cache argument `cache`, 5.23 `past_key_values`.
    cache_name = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    cache = DynamicCache(config=target.config)
    outputs = target(input_ids=token_ids, use_cache=True, output_hidden_states=hidden_request, **{cache_name: cache})
    features = torch.cat([outputs.hidden_states[i + 1] for i in layer_ids], -1)  # (rows, context, n*Ht)
    draft_cache = DFlashCache(config=drafter.config)

    def one_round(k: int) -> None:
        if k > 1:
            past = draft_cache.get_seq_length()
            block = token_ids[:, :k].clone()
            block[:, 1:] = drafter.config.mask_token_id
            draft_cache.set_previous_accepted_tokens(k)
            positions = torch.arange(past, past + 2 * k, device=device).expand(rows, -1)
            hidden = drafter(
                noise_embeds=embedding(block), context_hidden_states=features[:, :k], position_ids=positions,
                cache=draft_cache,
            ).last_hidden_state
            drafter.draft_logits(hidden[:, 1:], lm_head).max(-1)
            draft_cache.crop(-2 * k)
        target(input_ids=token_ids[:, :k], use_cache=True, output_hidden_states=hidden_request, **{cache_name: cache})
        cache.crop(-k)

    one_round(max(block_lengths))  # warm-up: first-call allocations and kernel selection
    times: dict[int, list[float]] = {k: [] for k in block_lengths}
    for _ in range(repeats):
        for k in block_lengths:
            _synchronize(device)
            start = time.perf_counter()
            one_round(k)
            _synchronize(device)
            times[k].append(time.perf_counter() - start)
    medians = torch.tensor([statistics.median(times[k]) for k in block_lengths])
    return tuple(medians.cummax(0).values.tolist())


def config_digest(config) -> str:
    """A hash of a model config's content (its name/path and the Transformers version excluded)."""
    content = {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    content["attn_implementation"] = config._attn_implementation
    return hashlib.sha256(json.dumps(content, sort_keys=True, default=str).encode()).hexdigest()[:16]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def cost_model_key(target: PreTrainedModel, drafter: DFlashDraftModel) -> dict:
    """What the round cost depends on: both configs, device, dtypes, torch version and CPU threads."""
    return {
        "target_config": config_digest(target.config),
        "drafter_config": config_digest(drafter.config),
        "device": device_name(target.device),
        "dtype": f"{target.dtype}/{drafter.dtype}".replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def cost_model_path(key: dict, cache_dir: str | Path | None = None) -> Path:
    """`<cache_dir or hf_dflash cache>/cost_models/<hash of key>.json`."""
    if cache_dir is None:
        from ..models import default_cache_dir

        cache_dir = default_cache_dir()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return Path(cache_dir) / "cost_models" / f"{digest}.json"


def read_cost_model(path: Path, key: dict, block_lengths: Sequence[int]) -> CostModel | None:
    """The cached model at `path`, or None when absent. A corrupt file, or one for another key or
    other block lengths, is ignored with a warning (it is measured again and overwritten)."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != COST_MODEL_FORMAT or data.get("key") != key:
            raise ValueError("it was written for another model pair, machine or format")
        model = CostModel.from_dict(data)
        if model.block_lengths != tuple(block_lengths):
            raise ValueError(f"it holds block lengths {model.block_lengths}, not {tuple(block_lengths)}")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as error:
        warnings.warn(f"Ignoring the DFlash cost model cache {path} ({error}); measuring again.", stacklevel=3)
        return None
    return model


def measured_cost_model(
    target: PreTrainedModel,
    drafter: DFlashDraftModel,
    rows: Sequence[int] = (1,),
    cache_dir: str | Path | None = None,
    measure: Callable[..., Sequence[float]] = measure_round_seconds,
) -> CostModel:
    """The cached cost model of this (target, drafter, machine), measuring the `rows` not cached yet.

    `measure(target, drafter, rows, block_lengths)` returns seconds per block length (injectable).
    The file is rewritten atomically, so concurrent runs never read half a file; a cache folder that
    cannot be written only warns.
    """
    key = cost_model_key(target, drafter)
    path = cost_model_path(key, cache_dir)
    lengths = measured_block_lengths(drafter.config.block_size)
    cached = read_cost_model(path, key, lengths)
    seconds = dict(cached.seconds) if cached is not None else {}
    missing = sorted(set(rows) - set(seconds))
    if not missing:
        return cached
    for count in missing:
        logger.info("Timing DFlash rounds of %d row(s) at block lengths %s (cached in %s).", count, lengths, path)
        seconds[count] = tuple(measure(target, drafter, count, lengths))
    model = CostModel(lengths, seconds)
    try:
        write_json_atomic(path, {"format": COST_MODEL_FORMAT, "key": key, **model.to_dict()})
    except OSError as error:  # a read-only cache costs a measurement per call, not the generation
        warnings.warn(f"Could not cache the DFlash cost model in {path} ({error}); set $HF_DFLASH_CACHE.", stacklevel=3)
    return model
