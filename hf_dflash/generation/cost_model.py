"""The cost model of the adaptive block size: seconds of one DFlash round per block length k and batch rows.

A round = drafter pass(k) + target verification pass(k). It is timed with the real models at a few k
(1, 2, 4, 8, 16 up to the drafter's block size B), once per (target config, drafter config, device,
dtypes, torch version, torch threads), and cached as JSON under `<hf_dflash cache>/cost_models/`
(written atomically; a corrupt file is measured again with a warning). Other k and row counts are
interpolated.

Hybrid drafting (a DFlash block plus n-gram drafts, verified as one tree) also needs the target
verification pass alone over n tokens (a tree of n nodes, with its 4D mask), up to 2B: a round with
block length k and m n-gram nodes costs round(k) + verify(k + m) - verify(k). These are timed the first
time hybrid drafting runs with a pair, and stored in the same file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DFlashCache, DynamicCache

from ..caches import cache_keyword
from ..json_files import write_json_atomic
from ..modeling_dflash import DFlashDraftModel

logger = logging.getLogger(__name__)

COST_MODEL_FORMAT = 1  # verification_* fields are optional: files without them stay valid
MEASURED_BLOCK_LENGTHS = (1, 2, 4, 8, 16)
MEASURED_VERIFICATION_LENGTHS = (1, 2, 4, 8, 12, 16, 20, 24, 32)


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
    verification_lengths: tuple[int, ...] = ()
    verification_seconds: dict[int, tuple[float, ...]] = field(default_factory=dict)

    def __post_init__(self):
        lengths = check_table("seconds", self.block_lengths, self.seconds, "block length")
        object.__setattr__(self, "block_lengths", lengths)
        object.__setattr__(self, "seconds", {rows: tuple(map(float, v)) for rows, v in sorted(self.seconds.items())})
        if self.verification_lengths or self.verification_seconds:
            verified = check_table(
                "verification_seconds", self.verification_lengths, self.verification_seconds, "token count"
            )
            object.__setattr__(self, "verification_lengths", verified)
            table = {rows: tuple(map(float, v)) for rows, v in sorted(self.verification_seconds.items())}
            object.__setattr__(self, "verification_seconds", table)

    @classmethod
    def from_function(
        cls,
        seconds: Callable[[int], float],
        max_block_size: int,
        verification: Callable[[int], float] | None = None,
        max_verified_tokens: int | None = None,
    ) -> CostModel:
        """A batch-1 model from `seconds(k)` at k = 1..max_block_size and, when given, `verification(n)` at
        n = 1..max_verified_tokens (default 2 * max_block_size) (synthetic models in tests)."""
        lengths = tuple(range(1, max_block_size + 1))
        if verification is None:
            return cls(lengths, {1: tuple(seconds(k) for k in lengths)})
        verified = tuple(range(1, (max_verified_tokens or 2 * max_block_size) + 1))
        return cls(
            lengths, {1: tuple(seconds(k) for k in lengths)}, verified, {1: tuple(verification(n) for n in verified)}
        )

    @property
    def has_verification(self) -> bool:
        return bool(self.verification_seconds)

    def round_seconds(self, rows: int, max_block_size: int) -> torch.Tensor:
        """(max_block_size,) float64: seconds of a round with block length k = 1..max_block_size."""
        return interpolated(self.block_lengths, self.seconds, rows, max_block_size)

    def verification_seconds_per_length(self, rows: int, max_tokens: int) -> torch.Tensor:
        """(max_tokens,) float64: seconds of one target verification pass over n = 1..max_tokens tokens.
        Without measured verification times, the round times stand in for them (their growth with k is
        then the growth of the verification pass plus the drafter's)."""
        if not self.has_verification:
            return interpolated(self.block_lengths, self.seconds, rows, max_tokens)
        return interpolated(self.verification_lengths, self.verification_seconds, rows, max_tokens)

    def tree_round_seconds(self, rows: int, max_block_size: int, max_ngram_tokens: int) -> torch.Tensor:
        """(max_block_size, max_ngram_tokens + 1) float64: seconds of a round with block length k (row k - 1)
        and m n-gram drafts beside the block (column m): round(k) + verify(k + m) - verify(k)."""
        rounds = self.round_seconds(rows, max_block_size)
        verify = self.verification_seconds_per_length(rows, max_block_size + max_ngram_tokens)
        nodes = torch.arange(1, max_block_size + 1)[:, None] + torch.arange(max_ngram_tokens + 1)[None]
        return rounds[:, None] + verify[nodes - 1] - verify[nodes[:, :1] - 1]

    def to_dict(self) -> dict:
        data = {
            "block_lengths": list(self.block_lengths),
            "seconds": {str(r): list(v) for r, v in self.seconds.items()},
        }
        if self.has_verification:
            data["verification_lengths"] = list(self.verification_lengths)
            data["verification_seconds"] = {str(r): list(v) for r, v in self.verification_seconds.items()}
        return data

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        """Inverse of `to_dict`; ValueError (or KeyError/TypeError) on a malformed dict."""
        return cls(
            tuple(data["block_lengths"]),
            {int(r): tuple(v) for r, v in data["seconds"].items()},
            tuple(data.get("verification_lengths", ())),
            {int(r): tuple(v) for r, v in data.get("verification_seconds", {}).items()},
        )


def check_table(name: str, lengths: Sequence[int], seconds: dict, unit: str) -> tuple[int, ...]:
    """ValueError unless `lengths` increase from 1 and `seconds` maps row counts >= 1 to one positive
    number per length; returns the lengths as a tuple."""
    lengths = tuple(lengths)
    label = "block_lengths" if name == "seconds" else "verification_lengths"
    if not lengths or lengths[0] != 1 or any(b <= a for a, b in zip(lengths, lengths[1:])):
        raise ValueError(f"CostModel.{label} must increase from 1, got {lengths!r}.")
    if not seconds:
        raise ValueError(f"CostModel.{name} is empty; give {{rows: seconds per {unit}}}.")
    for rows, values in seconds.items():
        if not isinstance(rows, int) or rows < 1:
            raise ValueError(f"CostModel.{name} keys are row counts >= 1, got {rows!r}.")
        if len(values) != len(lengths) or not all(value > 0 for value in values):
            raise ValueError(
                f"CostModel.{name}[{rows}] = {values!r} must hold {len(lengths)} positive seconds "
                f"(one per {unit} {lengths})."
            )
    return lengths


def interpolated(lengths: tuple[int, ...], table: dict[int, tuple[float, ...]], rows: int, size: int) -> torch.Tensor:
    """(size,) float64: table's seconds at 1..size for `rows` rows, interpolated in length (extended
    linearly past the last) and in rows (proportionally above the largest, as the smallest below it)."""
    measured = sorted(table)
    scale = 1.0
    if rows >= measured[-1]:
        scale, per_length = rows / measured[-1], table[measured[-1]]
    elif rows <= measured[0]:
        per_length = table[measured[0]]
    else:
        per_length = [interpolate(rows, measured, [table[r][i] for r in measured]) for i in range(len(lengths))]
    values = [scale * interpolate(k, lengths, per_length) for k in range(1, size + 1)]
    if min(values) <= 0:
        raise ValueError(f"The cost model extrapolates to non-positive seconds {values} for {rows} rows.")
    return torch.tensor(values, dtype=torch.float64)


def measured_block_lengths(block_size: int) -> tuple[int, ...]:
    """The k timed for a drafter of block size B: 1, 2, 4, 8, 16 up to B, and B."""
    return tuple(sorted({k for k in MEASURED_BLOCK_LENGTHS if k <= block_size} | {block_size}))


def measured_verification_lengths(block_size: int) -> tuple[int, ...]:
    """The token counts n of the verification pass timed for hybrid drafting: 1, 2, 4, 8, 12, ..., 32 up to
    2B, B and 2B (a tree holds the block and at most about as many n-gram drafts)."""
    return tuple(
        sorted({n for n in MEASURED_VERIFICATION_LENGTHS if n <= 2 * block_size} | {block_size, 2 * block_size})
    )


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
    cache_name = cache_keyword(target)
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
                noise_embeds=embedding(block),
                context_hidden_states=features[:, :k],
                position_ids=positions,
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


@torch.no_grad()
def measure_verification_seconds(
    target: PreTrainedModel,
    drafter: DFlashDraftModel,
    rows: int,
    lengths: Sequence[int],
    context_length: int = 32,
    repeats: int = 3,
) -> tuple[float, ...]:
    """Median seconds of one target verification pass over n tokens, per n in `lengths`, as a draft tree
    is verified: after a `context_length`-token prompt, with an explicit 4D tree mask, depth positions and
    the hidden states the drafter needs; the cache is cropped back after each pass. Timed in turn
    `repeats` times after one warm-up pass; evened out to never decrease with n (running maximum)."""
    from .tree import tree_attention_bias

    device = target.device
    hidden_request = [i + 1 for i in drafter.config.target_layer_ids]
    vocab = target.get_input_embeddings().num_embeddings
    context_length = max(context_length, max(lengths))
    token_ids = (torch.arange(rows * 2 * context_length, device=device) * 7919 % vocab).view(rows, -1)
    cache_name = cache_keyword(target)
    cache = DynamicCache(config=target.config)
    target(input_ids=token_ids[:, :context_length], use_cache=True, **{cache_name: cache})
    # the cost does not depend on the tree's shape: time a chain-shaped one
    inputs = {
        n: dict(
            input_ids=token_ids[:, context_length : context_length + n],
            attention_mask=tree_attention_bias(tuple(range(-1, n - 1)), context_length, target.dtype, device).expand(
                rows, -1, -1, -1
            ),
            position_ids=torch.arange(context_length, context_length + n, device=device).expand(rows, -1),
        )
        for n in lengths
    }

    def one_pass(n: int) -> None:
        target(**inputs[n], use_cache=True, output_hidden_states=hidden_request, **{cache_name: cache})
        cache.crop(-n)

    one_pass(max(lengths))
    times: dict[int, list[float]] = {n: [] for n in lengths}
    for _ in range(repeats):
        for n in lengths:
            _synchronize(device)
            start = time.perf_counter()
            one_pass(n)
            _synchronize(device)
            times[n].append(time.perf_counter() - start)
    medians = torch.tensor([statistics.median(times[n]) for n in lengths])
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
    other block lengths, is ignored with a warning (it is measured again and overwritten). Verification
    times for other token counts are dropped (measured again when needed)."""
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
    verified = measured_verification_lengths(max(block_lengths))
    if model.has_verification and model.verification_lengths != verified:
        model = CostModel(model.block_lengths, model.seconds)
    return model


def measured_cost_model(
    target: PreTrainedModel,
    drafter: DFlashDraftModel,
    rows: Sequence[int] = (1,),
    cache_dir: str | Path | None = None,
    measure: Callable[..., Sequence[float]] = measure_round_seconds,
    verification: bool = False,
    measure_verification: Callable[..., Sequence[float]] = measure_verification_seconds,
) -> CostModel:
    """The cached cost model of this (target, drafter, machine), measuring the `rows` not cached yet.

    `measure(target, drafter, rows, block_lengths)` returns seconds per block length (injectable); with
    `verification` (hybrid drafting), `measure_verification(target, drafter, rows, lengths)` the seconds
    of the verification pass alone per token count. The file is rewritten atomically, so concurrent runs
    never read half a file; a cache folder that cannot be written only warns.
    """
    key = cost_model_key(target, drafter)
    path = cost_model_path(key, cache_dir)
    lengths = measured_block_lengths(drafter.config.block_size)
    verified = measured_verification_lengths(drafter.config.block_size)
    cached = read_cost_model(path, key, lengths)
    seconds = dict(cached.seconds) if cached is not None else {}
    verification_seconds = dict(cached.verification_seconds) if cached is not None else {}
    missing = sorted(set(rows) - set(seconds))
    missing_verification = sorted(set(rows) - set(verification_seconds)) if verification else []
    if not missing and not missing_verification:
        return cached
    for count in missing:
        logger.info("Timing DFlash rounds of %d row(s) at block lengths %s (cached in %s).", count, lengths, path)
        seconds[count] = tuple(measure(target, drafter, count, lengths))
    for count in missing_verification:
        logger.info("Timing verification passes of %d row(s) over %s tokens (cached in %s).", count, verified, path)
        verification_seconds[count] = tuple(measure_verification(target, drafter, count, verified))
    model = CostModel(lengths, seconds, verified if verification_seconds else (), verification_seconds)
    try:
        write_json_atomic(path, {"format": COST_MODEL_FORMAT, "key": key, **model.to_dict()})
    except OSError as error:  # a read-only cache costs a measurement per call, not the generation
        warnings.warn(f"Could not cache the DFlash cost model in {path} ({error}); set $HF_DFLASH_CACHE.", stacklevel=3)
    return model
