"""Timing the cost model with the real models, once per (target, drafter, machine), cached as JSON.

The block lengths 1, 2, 4, 8, 16 up to the drafter's block size B are timed once per (target config,
drafter config, device, dtypes, torch version, torch threads) and cached under
`<hf_dflash cache>/cost_models/` (written atomically; a corrupt file is measured again with a warning).
Hybrid drafting also times the target verification pass alone over n tokens (a tree of n nodes, with its
4D mask), the first time it runs with a pair, stored in the same file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache

from ...caches import cache_keyword
from ...json_files import write_json_atomic
from ...modeling_dflash import DFlashDraftModel
from ...packed_linears import is_packed
from ...target_features import target_layer_features
from ..drafting.block_drafter import BlockDrafter
from ..verifying.tree_verification import tree_attention_bias
from .cost_model import CostModel, measured_block_lengths, measured_verification_lengths

logger = logging.getLogger(__name__)

COST_MODEL_FORMAT = 2  # 2: rounds timed with the served drafter pass; verification_* and drafting_* fields are optional
# Verification passes are timed after this many context tokens (part of the cache key). A served round
# verifies after the prompt and the answer so far, and a tree's attention grows with nodes x context:
# timed after 64 tokens, 48-node trees looked as cheap as 24-node ones and "auto" chose them, where served
# they cost 1.5x an 8-node pass; after 256, "auto" matched the best fixed size
# (benchmarks/generation/tree_budget.py, docs/results-history.md "Draft-tree budget").
VERIFICATION_CONTEXT = 256


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def time_in_turn(run: Callable[[int], None], sizes: Sequence[int], repeats: int, device: torch.device) -> tuple:
    """Seconds of `run(size)` per size: the fastest of `repeats` calls timed in turn (other work on the
    machine only ever slows a call down, and a spike of one size would otherwise price every larger one),
    after one warm-up call of each size (first-call allocations and per-shape kernel selection). A pass
    never gets cheaper with its size, so noise that says otherwise is evened out (running maximum)."""
    for size in sizes:
        run(size)
    times: dict[int, list[float]] = {size: [] for size in sizes}
    for _ in range(repeats):
        for size in sizes:
            _synchronize(device)
            start = time.perf_counter()
            run(size)
            _synchronize(device)
            times[size].append(time.perf_counter() - start)
    fastest = torch.tensor([min(times[size]) for size in sizes])
    return tuple(fastest.cummax(0).values.tolist())


class ServedRound:
    """One served round after a `context_length`-token prompt, as `generate` runs it: the drafter pass
    (`BlockDrafter`, its cache holding the prompt's features) over k new context features and a k-token block
    with its greedy LM head on the k-1 draft slots, and the target forward over k tokens with the hidden
    states the drafter needs. Both caches are rolled back after each pass; no random numbers are used, so
    timing never changes what `generate` samples."""

    def __init__(self, target: PreTrainedModel, drafter: DFlashDraftModel, rows: int, context_length: int):
        layer_ids = list(drafter.config.target_layer_ids)
        self.target, self.hidden_request = target, [i + 1 for i in layer_ids]
        vocab = target.get_input_embeddings().num_embeddings
        self.token_ids = (torch.arange(rows * context_length, device=target.device) * 7919 % vocab).view(rows, -1)
        self.cache_name = cache_keyword(target)
        self.cache = DynamicCache(config=target.config)
        self.cache.activate_past_recording()  # sliding-window layers roll back only with it, as in `generate`
        outputs = self.target_pass(self.token_ids, keep=True)
        self.features = target_layer_features(outputs.hidden_states, layer_ids, context_length)  # (rows, ctx, n*Ht)
        self.valid = self.token_ids.new_ones(rows, context_length)
        self.block = BlockDrafter(drafter, target)
        self.block.add_context(self.features, self.valid)
        self.block.draft_hidden(self.token_ids[:, -1], 1)

    def target_pass(self, token_ids: torch.LongTensor, keep: bool = False):
        outputs = self.target(
            input_ids=token_ids,
            use_cache=True,
            output_hidden_states=self.hidden_request,
            **{self.cache_name: self.cache},
        )
        if not keep:
            self.cache.crop(-token_ids.shape[1])
        return outputs

    def draft(self, k: int) -> None:
        """The drafter's pass of block length k >= 2."""
        self.block.add_context(self.features[:, :k], self.valid[:, :k])
        last = self.token_ids[:, -1]
        self.block.draft(self.block.draft_hidden(last, k), do_sample=False, anchors=last)
        self.block.rewind(k)

    def round(self, k: int) -> None:
        """Drafting (k > 1) then the target's verification forward over k tokens."""
        if k > 1:
            self.draft(k)
        self.target_pass(self.token_ids[:, :k])


@torch.no_grad()
def measure_round_seconds(
    target: PreTrainedModel,
    drafter: DFlashDraftModel,
    rows: int,
    block_lengths: Sequence[int],
    context_length: int = VERIFICATION_CONTEXT,
    repeats: int = 5,
) -> tuple[float, ...]:
    """Seconds of one round per block length k (`time_in_turn`), timed with the real models: the served
    drafter pass and the target's forward over k tokens (`ServedRound.round`; k = 1: the forward alone)."""
    served = ServedRound(target, drafter, rows, max(context_length, max(block_lengths)))
    return time_in_turn(served.round, block_lengths, repeats, target.device)


@torch.no_grad()
def measure_drafting_seconds(
    target: PreTrainedModel,
    drafter: DFlashDraftModel,
    rows: int,
    block_lengths: Sequence[int],
    context_length: int = VERIFICATION_CONTEXT,
    repeats: int = 5,
) -> tuple[float, ...]:
    """Seconds of the drafter's pass alone per block length k (`ServedRound.draft`; 0 at k = 1, no pass). Under
    compiled verification a round costs this + one fixed-width verification: read off as round - verification
    instead, two timings taken apart, it came out at 0 in fp32 (a tree-masked 8-token verification timed slower
    than the round's whole), so drafting looked free."""
    served = ServedRound(target, drafter, rows, max(context_length, max(block_lengths)))
    drafted = [k for k in block_lengths if k > 1]
    seconds = dict(zip(drafted, time_in_turn(served.draft, drafted, repeats, target.device))) if drafted else {}
    return tuple(seconds.get(k, 0.0) for k in block_lengths)


@torch.no_grad()
def measure_verification_seconds(
    target: PreTrainedModel,
    drafter: DFlashDraftModel,
    rows: int,
    lengths: Sequence[int],
    context_length: int = VERIFICATION_CONTEXT,
    repeats: int = 5,
) -> tuple[float, ...]:
    """Seconds of one target verification pass over n tokens (`time_in_turn`), per n in `lengths`, as a draft
    tree is verified: after a `context_length`-token prompt, with an explicit 4D tree mask, depth positions
    and the hidden states the drafter needs; the cache is cropped back after each pass."""
    device = target.device
    hidden_request = [i + 1 for i in drafter.config.target_layer_ids]
    vocab = target.get_input_embeddings().num_embeddings
    context_length = max(context_length, max(lengths))
    token_ids = (torch.arange(rows * 2 * context_length, device=device) * 7919 % vocab).view(rows, -1)
    cache_name = cache_keyword(target)
    cache = DynamicCache(config=target.config)
    cache.activate_past_recording()  # sliding-window layers roll back only with it, as in `generate`
    target(input_ids=token_ids[:, :context_length], use_cache=True, **{cache_name: cache})
    # the cost does not depend on the tree's shape: time a chain-shaped one, through the 4D tree mask where the
    # target takes it (a sliding layer sees fewer keys than one mask for all layers has: there, the causal mask)
    sliding = any(type(layer).__name__ == "DynamicSlidingWindowLayer" for layer in cache.layers)
    inputs = {
        n: dict(
            input_ids=token_ids[:, context_length : context_length + n],
            position_ids=torch.arange(context_length, context_length + n, device=device).expand(rows, -1),
        )
        for n in lengths
    }
    if not sliding:
        for n, step in inputs.items():
            chain = tree_attention_bias(tuple(range(-1, n - 1)), context_length, target.dtype, device)
            step["attention_mask"] = chain.expand(rows, -1, -1, -1)

    def one_pass(n: int) -> None:
        target(**inputs[n], use_cache=True, output_hidden_states=hidden_request, **{cache_name: cache})
        cache.crop(-n)

    return time_in_turn(one_pass, lengths, repeats, device)


# Config fields that change no forward's cost: a model's name/path, the Transformers version that wrote it, and the
# block size policy a drafter recommends (a serving choice; re-timing a machine for it would only add noise).
COSTLESS_CONFIG_FIELDS = ("_name_or_path", "transformers_version", "block_size_policy")


def config_digest(config) -> str:
    """A hash of a model config's content (`COSTLESS_CONFIG_FIELDS` excluded)."""
    content = {k: v for k, v in config.to_dict().items() if k not in COSTLESS_CONFIG_FIELDS}
    content["attn_implementation"] = config._attn_implementation
    return hashlib.sha256(json.dumps(content, sort_keys=True, default=str).encode()).hexdigest()[:16]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def cost_model_key(target: PreTrainedModel, drafter: DFlashDraftModel) -> dict:
    """What the round cost depends on: both configs, device, dtypes, torch version, CPU threads, whether the
    target's linear layers run packed (and the context its verification passes are timed after)."""
    return {
        "target_config": config_digest(target.config),
        "drafter_config": config_digest(drafter.config),
        "device": device_name(target.device),
        "dtype": f"{target.dtype}/{drafter.dtype}".replace("torch.", ""),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "verification_context": VERIFICATION_CONTEXT,
        "linear_packing": is_packed(target),  # timed inside `packed_linears` or not
    }


def cost_model_path(key: dict, cache_dir: str | Path | None = None) -> Path:
    """`<cache_dir or hf_dflash cache>/cost_models/<hash of key>.json`."""
    if cache_dir is None:
        from ...targets import default_cache_dir

        cache_dir = default_cache_dir()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return Path(cache_dir) / "cost_models" / f"{digest}.json"


def read_cost_model(
    path: Path, key: dict, block_lengths: Sequence[int], verified: Sequence[int] = ()
) -> CostModel | None:
    """The cached model at `path`, or None when absent. A corrupt file, or one for another key or
    other block lengths, is ignored with a warning (it is measured again and overwritten). Verification
    times that miss some of the token counts `verified` are dropped (measured again when needed)."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != COST_MODEL_FORMAT or data.get("key") != key:
            raise ValueError("it was written for another model pair, machine or format")
        model = CostModel.from_dict(data)
        if model.block_lengths != tuple(block_lengths):
            raise ValueError(f"it holds block lengths {model.block_lengths}, not {tuple(block_lengths)}")
        if not data.get("timed_together", False):
            check_consistent(model)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as error:
        warnings.warn(f"Ignoring the DFlash cost model cache {path} ({error}); measuring again.", stacklevel=3)
        return None
    if model.has_verification and not set(verified) <= set(model.verification_lengths):
        model = CostModel(model.block_lengths, model.seconds, drafting_seconds=model.drafting_seconds)  # measured again
    return model


TIMING_DISAGREEMENT = 1.5  # most a cached model's two timings of one forward may differ before it is re-timed


def check_consistent(model: CostModel) -> None:
    """ValueError when the model's two timings of the same forward disagree: a round of block length 1 is one
    target forward over 1 token, as is a verification pass of 1 token; the two are timed at different times
    (verification when a call first needs it), so one that is `TIMING_DISAGREEMENT`x the other was taken while
    something else ran on the machine, and would misprice every round after it. A cache file is checked unless
    both were timed in one go (`timed_together`: then the disagreement is the machine's)."""
    for rows in set(model.seconds) & set(model.verification_seconds):
        step, verify = model.seconds[rows][0], model.verification_seconds[rows][0]
        if max(step, verify) > TIMING_DISAGREEMENT * min(step, verify):
            raise ValueError(
                f"its 1-token forward of {rows} row(s) was timed {1000 * step:.1f} ms in a round and "
                f"{1000 * verify:.1f} ms alone: timed while something else ran"
            )


def measured_cost_model(
    target: PreTrainedModel,
    drafter: DFlashDraftModel,
    rows: Sequence[int] = (1,),
    cache_dir: str | Path | None = None,
    measure: Callable[..., Sequence[float]] = measure_round_seconds,
    verification: bool = False,
    measure_verification: Callable[..., Sequence[float]] = measure_verification_seconds,
    max_verified_tokens: int | None = None,
    measure_drafting: Callable[..., Sequence[float]] = measure_drafting_seconds,
) -> CostModel:
    """The cached cost model of this (target, drafter, machine), measuring the `rows` not cached yet.

    `measure(target, drafter, rows, block_lengths)` returns seconds per block length (injectable); with
    `verification` (hybrid drafting, trees, compiled verification), `measure_verification(target, drafter, rows,
    lengths)` the seconds of the verification pass alone per token count, up to `max_verified_tokens` (default 2B;
    draft trees ask for more; cached times over a larger set of counts serve a smaller one), and
    `measure_drafting(target, drafter, rows, block_lengths)` the drafter's pass alone per block length. The file
    is rewritten atomically, so concurrent runs never read half a file; a cache folder that cannot be written
    only warns.
    """
    key = cost_model_key(target, drafter)
    path = cost_model_path(key, cache_dir)
    lengths = measured_block_lengths(drafter.config.block_size)
    verified = measured_verification_lengths(drafter.config.block_size, max_verified_tokens)
    cached = read_cost_model(path, key, lengths, verified)
    seconds = dict(cached.seconds) if cached is not None else {}
    verification_seconds = dict(cached.verification_seconds) if cached is not None else {}
    drafting_seconds = dict(cached.drafting_seconds) if cached is not None else {}
    if cached is not None and cached.has_verification:
        verified = cached.verification_lengths  # a larger set than asked for serves it (`read_cost_model`)
    missing = sorted(set(rows) - set(seconds))
    missing_verification = sorted(set(rows) - set(verification_seconds)) if verification else []
    missing_drafting = sorted(set(rows) - set(drafting_seconds)) if verification else []
    if not missing and not missing_verification and not missing_drafting:
        return cached
    for count in missing:
        logger.info("Timing DFlash rounds of %d row(s) at block lengths %s (cached in %s).", count, lengths, path)
        seconds[count] = tuple(measure(target, drafter, count, lengths))
    for count in missing_verification:
        logger.info("Timing verification passes of %d row(s) over %s tokens (cached in %s).", count, verified, path)
        verification_seconds[count] = tuple(measure_verification(target, drafter, count, verified))
    for count in missing_drafting:
        logger.info("Timing the drafter's pass of %d row(s) at block lengths %s (cached in %s).", count, lengths, path)
        drafting_seconds[count] = tuple(measure_drafting(target, drafter, count, lengths))
    verified_lengths = verified if verification_seconds else ()
    model = CostModel(lengths, seconds, verified_lengths, verification_seconds, drafting_seconds)
    together = cached is None and bool(missing_verification)  # both tables timed now, one after the other
    try:
        write_json_atomic(
            path, {"format": COST_MODEL_FORMAT, "key": key, "timed_together": together, **model.to_dict()}
        )
    except OSError as error:  # a read-only cache costs a measurement per call, not the generation
        warnings.warn(f"Could not cache the DFlash cost model in {path} ({error}); set $HF_DFLASH_CACHE.", stacklevel=3)
    return model
