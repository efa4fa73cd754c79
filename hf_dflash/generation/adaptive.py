"""Adaptive block size: how many tokens to draft each round, chosen from the acceptance seen so far.

A drafter trained at block size B drafts a shorter block `[bonus, MASK x (k-1)]` for any k <= B
(k = 1: no drafter pass, a plain decoding step). Verification is unchanged, so every k is lossless;
only the speed depends on k. The adaptive policy picks the k with the most committed tokens per second:

    p_i  = P(draft slot i accepted | slots before it accepted)      running estimate per row, i = 1..B-1
    E(k) = 1 + sum_{j=1}^{k-1} prod_{i<=j} p_i                       expected tokens committed by a round
    k*   = argmax_k sum_rows E_r(k) / cost(rows, k)                  one k per round (one pass) for a batch

cost(rows, k) = drafter pass(k) + target verification pass(k) in seconds, timed once with the real
models per (target, drafter, device, dtype, torch threads) and cached as JSON under
`<hf_dflash cache>/cost_models/`.

Opt in on the drafter (a setting read by `generate`, like Transformers' assistant settings):

    drafter.block_size_policy = "adaptive"                # or AdaptiveBlockSize(decay=..., cost_model=...)
    drafter.block_size_policy = 8                         # a fixed shorter block
    drafter.block_size_policy = lambda round_index: 4     # an explicit schedule: k for each round
    drafter.block_size_policy = None                      # default: the trained block size B
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DFlashCache, DynamicCache

from ..json_files import write_json_atomic
from ..modeling_dflash import DFlashDraftModel

logger = logging.getLogger(__name__)

POLICY_ATTRIBUTE = "block_size_policy"  # the drafter attribute `generate` reads
COST_MODEL_FORMAT = 1
MEASURED_BLOCK_LENGTHS = (1, 2, 4, 8, 16)


# --- acceptance estimates (pure) ---


def update_acceptance_counts(
    successes: torch.Tensor,
    trials: torch.Tensor,
    num_drafts: torch.Tensor,
    num_accepted: torch.Tensor,
    decay: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Discounted per-slot counts after one round.

    successes, trials (R, S): discounted accepted drafts / reached draft slots of each row, S = B - 1,
    column i = draft slot i + 1; num_drafts (R,) drafts offered to each row this round; num_accepted (R,)
    drafts it accepted. Column i was a trial when reached (i <= accepted) and offered (i < drafts); a
    success when i < accepted. Every count first decays by `decay`, reached or not, so old evidence fades and a slot
    that is no longer tried drifts back to its prior (which makes the policy try it again).
    """
    slots = torch.arange(successes.shape[1], device=successes.device)
    accepted = num_accepted.to(successes.device)[:, None]
    reached = (slots <= accepted) & (slots < num_drafts.to(successes.device)[:, None])
    return decay * successes + (slots < accepted), decay * trials + reached


def acceptance_probabilities(
    successes: torch.Tensor, trials: torch.Tensor, prior: float, prior_weight: float
) -> torch.Tensor:
    """p (R, S): P(slot i accepted | slots < i accepted) from the counts (R, S).

    Each slot's estimate shrinks toward a prior worth `prior_weight` trials: the first draft's toward
    `prior`, every later one's toward the estimate of the slot before it. A slot rarely reached is thus
    assumed to accept like the one before it: with the optimistic prior instead, the slots a poor drafter
    never reaches would keep long blocks attractive.
    """
    p = torch.empty_like(successes)
    previous = torch.full_like(successes[:, :1], prior)
    for slot in range(successes.shape[1]):
        column = slice(slot, slot + 1)
        previous = (successes[:, column] + prior_weight * previous) / (trials[:, column] + prior_weight)
        p[:, column] = previous
    return p


def expected_tokens(p: torch.Tensor) -> torch.Tensor:
    """E (R, S+1) from p (R, S) (column i - 1 = draft slot i): E[:, k-1] = E(k) = 1 + sum_{j=1}^{k-1}
    prod_{i<=j} p_i, the tokens committed by a round with block length k (the bonus token plus the
    expected accepted drafts)."""
    return torch.cat([torch.ones_like(p[:, :1]), 1 + p.cumprod(1).cumsum(1)], 1)


def best_block_size(expected: torch.Tensor, seconds: torch.Tensor) -> int:
    """argmax_k sum_r E_r(k) / seconds(k), the smallest k on ties. expected (R, B); seconds (B,)."""
    return int((expected.sum(0) / seconds).argmax()) + 1  # argmax returns the first maximum


# --- cost model ---


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
            lm_head(hidden[:, 1:]).max(-1)
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


# --- policies ---


class BlockSizeController(Protocol):
    """Chooses k for each round of one `generate` call and learns from the outcome."""

    def choose(self, rows: Sequence[int]) -> int:
        """k for the next round; rows: the active rows' indices in the original batch."""

    def observe(self, rows: Sequence[int], num_drafts: int, num_accepted: torch.Tensor) -> None:
        """The round verified `num_drafts` drafts for every row in `rows`; num_accepted (R,)."""


@dataclass
class FixedBlockSize:
    """The same k every round (the default: the drafter's trained block size)."""

    block_size: int

    def choose(self, rows: Sequence[int]) -> int:
        return self.block_size

    def observe(self, rows: Sequence[int], num_drafts: int, num_accepted: torch.Tensor) -> None:
        pass


@dataclass
class ScheduledBlockSize:
    """k = schedule(round_index) (0 = first drafting round), checked against 1 <= k <= max_block_size."""

    schedule: Callable[[int], int]
    max_block_size: int
    round_index: int = 0

    def choose(self, rows: Sequence[int]) -> int:
        k = self.schedule(self.round_index)
        if not is_block_size(k, self.max_block_size):
            raise ValueError(
                f"The block size schedule returned {k!r} for round {self.round_index}; it must return an int k "
                f"with 1 <= k <= {self.max_block_size} (the drafter's block_size)."
            )
        self.round_index += 1
        return k

    def observe(self, rows: Sequence[int], num_drafts: int, num_accepted: torch.Tensor) -> None:
        pass


@dataclass
class AdaptiveBlockSize:
    """Choose k each round to maximise expected committed tokens per second (see the module docstring).

    decay: weight kept by past evidence each round (0.9: about the last 10 rounds count; 1: nothing is
        forgotten, and a block length once abandoned is never tried again);
    prior: the first draft's acceptance before any evidence (1.0, optimistic: the first rounds use whole
        blocks; later drafts start from the estimate of the draft before them);
    prior_weight: how many trials the prior is worth;
    cost_model: seconds per round; None measures it once per model pair and machine, cached in
    `cache_dir` (default: the hf_dflash cache directory, `$HF_DFLASH_CACHE`) under `cost_models/`.
    """

    decay: float = 0.9
    prior: float = 1.0
    prior_weight: float = 1.0
    cost_model: CostModel | None = None
    cache_dir: str | Path | None = None

    def __post_init__(self):
        if not 0 < self.decay <= 1:
            raise ValueError(f"AdaptiveBlockSize.decay must be in (0, 1], got {self.decay!r}.")
        if not 0 <= self.prior <= 1:
            raise ValueError(f"AdaptiveBlockSize.prior is a probability in [0, 1], got {self.prior!r}.")
        if not self.prior_weight > 0:
            raise ValueError(f"AdaptiveBlockSize.prior_weight must be > 0, got {self.prior_weight!r}.")

    def start(self, target: PreTrainedModel, drafter: DFlashDraftModel, batch_size: int) -> "AdaptiveController":
        """The controller of one `generate` call (measures or loads the cost model when none was given)."""
        cost_model = self.cost_model
        if cost_model is None:
            cost_model = measured_cost_model(target, drafter, sorted({1, batch_size}), self.cache_dir)
        return AdaptiveController(self, drafter.config.block_size, batch_size, cost_model)


@dataclass
class AdaptiveController:
    """Per-row acceptance counts of one `generate` call and the argmax of tokens per second."""

    policy: AdaptiveBlockSize
    max_block_size: int
    batch_size: int
    cost_model: CostModel
    successes: torch.Tensor = field(init=False)  # (batch, B-1) discounted
    trials: torch.Tensor = field(init=False)  # (batch, B-1) discounted
    seconds: dict[int, torch.Tensor] = field(init=False, default_factory=dict)  # rows -> (B,)

    def __post_init__(self):
        self.successes = torch.zeros(self.batch_size, self.max_block_size - 1, dtype=torch.float64)
        self.trials = torch.zeros_like(self.successes)

    def choose(self, rows: Sequence[int]) -> int:
        if len(rows) not in self.seconds:
            self.seconds[len(rows)] = self.cost_model.round_seconds(len(rows), self.max_block_size)
        index = list(rows)
        p = acceptance_probabilities(
            self.successes[index], self.trials[index], self.policy.prior, self.policy.prior_weight
        )
        return best_block_size(expected_tokens(p), self.seconds[len(rows)])

    def observe(self, rows: Sequence[int], num_drafts: int, num_accepted: torch.Tensor) -> None:
        index = list(rows)
        offered = torch.full((len(index),), num_drafts)
        self.successes[index], self.trials[index] = update_acceptance_counts(
            self.successes[index], self.trials[index], offered, num_accepted.cpu(), self.policy.decay
        )


def is_block_size(k, max_block_size: int) -> bool:
    return isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= max_block_size


def block_size_controller(
    drafter: DFlashDraftModel, target: PreTrainedModel, batch_size: int
) -> BlockSizeController:
    """The controller for one `generate` call from `drafter.block_size_policy` (unset: fixed B).

    Accepted policies: None (the trained block size B), an int 1 <= k <= B, "adaptive", an
    `AdaptiveBlockSize`, or a callable round_index -> k. Anything else raises ValueError.
    """
    max_block_size = drafter.config.block_size
    # An optional user setting on our own model class, not state: unset means the default.
    policy = getattr(drafter, POLICY_ATTRIBUTE, None)
    if policy is None:
        return FixedBlockSize(max_block_size)
    if isinstance(policy, str) and policy == "adaptive":
        policy = AdaptiveBlockSize()
    if isinstance(policy, AdaptiveBlockSize):
        return policy.start(target, drafter, batch_size)
    if is_block_size(policy, max_block_size):
        return FixedBlockSize(policy)
    if callable(policy):
        return ScheduledBlockSize(policy, max_block_size)
    raise ValueError(
        f"drafter.block_size_policy = {policy!r} is not a block size policy. Use None (the trained block size "
        f"{max_block_size}), an int k with 1 <= k <= {max_block_size}, 'adaptive', an AdaptiveBlockSize(...), "
        "or a callable round_index -> k."
    )
