"""The decoding methods a benchmark compares, and one timed `generate` call of each.

    plain    target.generate(...)                                    greedy (or sampling) baseline
    dflash   target.generate(..., assistant_model=drafter)           this package's DFlash loop
    builtin  ... assistant_model=drafter, speculation_type="dflash"  Transformers' built-in DFlash loop
    lookup   ... prompt_lookup_num_tokens=10                         prompt-lookup decoding
    hybrid   ... assistant_model=drafter, prompt_lookup_num_tokens=10  DFlash block + n-gram drafts as one tree
    tree     ... assistant_model=drafter with drafter.draft_tree = "auto"  the drafter's own draft tree, sized
             by the measured cost of verification
    hybrid-tree  hybrid with drafter.draft_tree = "auto": the n-gram branch grafted onto the drafter's tree
    plain-alt  plain decoding with the target in the OTHER dtype (bf16 <-> fp32)
    plain-packed  plain decoding with the target's linear layers through oneDNN with prepacked weights
             (`hf_dflash.packed_linears`, the layout our loop keeps): the CPU lever our loop's "auto" uses, offered
             to the baseline too
    plain-compiled  plain decoding with a StaticCache and Transformers' automatic `torch.compile` of the
             decoding step (`compile_config`, also on CPU); the cache holds the request rounded up to a
             multiple of 256 slots (a step attends over every slot: SmolLM2's fp32 compiled step costs 66 ms
             over 512 slots, 100 over 2,048); each length is a graph, compiled by an untimed warm-up call
             the first time it comes (reported apart), never by a timed one; sliding-window layers are full
             static layers masked by the window (`static_cache`: Transformers' own recompiled every step)
    plain-packed-compiled  plain-packed with the same StaticCache and `compile_config` (the packed products
             reach the compiled step as one op each, `hf_dflash.packed_linears.packed_linear`)
    dflash-compiled  dflash with the same StaticCache and `compile_config`: our loop compiles its verification
             forward (one width per call: shorter rounds padded; its linear layers packed where that pays, as
             eager rounds are), the prefill stays eager
The baseline is the fastest of the plain decodings that ran, so no speed-up is bought with a slow baseline.
A compiled call counts the graphs compiled while it is timed (`Generation.compiles`, `recompiles.py`): a row with
any did not settle in its warm-up, is flagged in the report and is never the baseline.

Acceptance lengths (tokens committed per verification round, bonus token included): our loop reports
them in `drafter.last_acceptance`; for the other speculative methods they are read off the target's
forwards with a forward pre-hook (each forward is one round; where it starts tells how many tokens the
round before it committed). DFlash's prefill drafts nothing (it only produces the prompt features), so
for both DFlash loops the prefill is not a round; prompt lookup drafts from the prompt in its very first
forward, so there it is one.

Hybrid runs (with or without the drafter's tree) also report where their committed tokens came from
(`Generation.branches`); they and tree runs, per round, the tree's size and the wall time of its target forward (`Generation.round_costs`, timed
with forward hooks on the target).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ..generation.policies.tree_size import AUTO_MAX_NODES
from ..generation.verifying.compiling import compiled_generate_kwargs, static_slots
from ..packed_linears import packed_linears
from .recompiles import CompileCounter

__all__ = [
    "COMPILED_METHODS",
    "EAGER_METHODS",
    "METHODS",
    "PLAIN_METHODS",
    "PROMPT_LOOKUP_NUM_TOKENS",
    "HYBRID_METHODS",
    "TREE_METHODS",
    "ForwardRecorder",
    "ForwardTimer",
    "Generation",
    "branch_tokens",
    "check_methods",
    "eager_method",
    "generate_with",
    "max_round_length",
]

EAGER_METHODS = ("plain", "dflash", "builtin", "lookup", "tree", "hybrid", "hybrid-tree", "plain-alt", "plain-packed")
# StaticCache + compile_config (`compiled_generate_kwargs`), compiled in the warm-up: X-compiled runs X compiled
COMPILED_METHODS = (
    "plain-compiled",
    "plain-packed-compiled",
    "dflash-compiled",
    "tree-compiled",
    "hybrid-compiled",
    "hybrid-tree-compiled",
)
METHODS = EAGER_METHODS + COMPILED_METHODS
TREE_SETTING = "auto"  # drafter.draft_tree of the "tree" and "hybrid-tree" methods
TREE_METHODS = ("tree", "hybrid-tree", "tree-compiled", "hybrid-tree-compiled")  # the drafter drafts its own tree
HYBRID_METHODS = ("hybrid", "hybrid-tree", "hybrid-compiled", "hybrid-tree-compiled")  # + an n-gram branch, one tree
OWN_LOOP_METHODS = ("dflash", "dflash-compiled", *TREE_METHODS, *HYBRID_METHODS)  # rounds reported by our loop
# no drafting: the candidates for the baseline
PLAIN_METHODS = ("plain", "plain-alt", "plain-compiled", "plain-packed", "plain-packed-compiled")
PACKED_PLAIN_METHODS = ("plain-packed", "plain-packed-compiled")  # plain decoding inside `packed_linears(target)`
PROMPT_LOOKUP_NUM_TOKENS = 10


@dataclass
class Generation:
    """One timed `generate` call."""

    sequences: torch.LongTensor  # (1, prompt_length + new_tokens)
    seconds: float
    acceptance_lengths: list[int] | None  # tokens committed per round; None for plain decoding
    block_sizes: list[int] | None = None  # our DFlash loop: the block length k of every round
    # hybrid only: committed tokens by origin {"block", "ngram", "shared", "bonus"} (drafts accepted from the
    # DFlash block only, the n-gram branch only, both; the target's bonus token of each round) ...
    branches: dict[str, int] | None = None
    # ... and [tree nodes, target forward seconds] per round after the prefill
    round_costs: list[list[float]] | None = None
    # compiled methods: graphs dynamo compiled during the timed call (0 once the warm-up settled); eager: None
    compiles: int | None = None


class ForwardTimer:
    """Context manager timing every forward of `module` (wall clock, synchronised on CUDA)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.seconds: list[float] = []

    def __enter__(self) -> ForwardTimer:
        self.handles = [
            self.module.register_forward_pre_hook(self._start),
            self.module.register_forward_hook(self._stop),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()

    # A compiled target's call runs its hooks inside torch.compile: they stay outside the graph (dynamo cannot
    # trace time.perf_counter, torch 2.13, and would recompile them until its limit).
    @torch.compiler.disable
    def _start(self, module, args) -> None:
        _synchronize(self.module.device)
        self.started = time.perf_counter()

    @torch.compiler.disable
    def _stop(self, module, args, output) -> None:
        _synchronize(self.module.device)
        self.seconds.append(time.perf_counter() - self.started)


def branch_tokens(stats) -> dict[str, int]:
    """Committed tokens of a hybrid call by origin, from its `AcceptanceStats`."""
    shared = sum(min(block, ngram) for block, ngram in zip(stats.block_tokens, stats.ngram_tokens))
    return {
        "block": sum(stats.block_tokens) - shared,
        "ngram": sum(stats.ngram_tokens) - shared,
        "shared": shared,
        "bonus": len(stats.acceptance_lengths),
    }


class ForwardRecorder:
    """Context manager recording where each target forward starts (its first position id)."""

    def __init__(self, target: torch.nn.Module):
        self.target = target
        self.starts: list[int] = []

    def __enter__(self) -> ForwardRecorder:
        self.handle = self.target.register_forward_pre_hook(self._record, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()

    def _record(self, module, args, kwargs) -> None:
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            raise RuntimeError(
                f"{type(module).__name__}.forward got no position_ids inside generate(): cannot tell how many "
                "tokens each verification round committed."
            )
        self.starts.append(int(position_ids[0, 0]))

    def committed_per_forward(self, prompt_length: int, total_length: int) -> list[int]:
        """Tokens committed by each recorded forward. Before forward i > 0 the sequence holds `starts[i] + 1`
        tokens (the forward re-reads the last committed token); the prefill sees the prompt."""
        before = [prompt_length] + [start + 1 for start in self.starts[1:]]
        after = before[1:] + [total_length]
        return [end - begin for begin, end in zip(before, after)]


def check_methods(methods) -> None:
    """ValueError unless `methods` is a non-empty selection of `METHODS`."""
    unknown = [method for method in methods if method not in METHODS]
    if unknown or not methods:
        raise ValueError(f"Unknown or no methods {list(methods)}; choose from {', '.join(METHODS)}.")


def method_kwargs(method: str, drafter: torch.nn.Module | None) -> dict:
    """The `generate` keyword arguments that select `method` (compiled methods: + `compiled_generate_kwargs`)."""
    if method in (*OWN_LOOP_METHODS, "builtin") and drafter is None:
        raise ValueError(f"Method {method!r} needs a drafter.")
    return {
        "plain": {},
        "plain-alt": {},
        "plain-packed": {},
        "dflash": {"assistant_model": drafter},
        "tree": {"assistant_model": drafter},
        "builtin": {"assistant_model": drafter, "speculation_type": "dflash"},
        "lookup": {"prompt_lookup_num_tokens": PROMPT_LOOKUP_NUM_TOKENS},
        "hybrid": {"assistant_model": drafter, "prompt_lookup_num_tokens": PROMPT_LOOKUP_NUM_TOKENS},
        "hybrid-tree": {"assistant_model": drafter, "prompt_lookup_num_tokens": PROMPT_LOOKUP_NUM_TOKENS},
    }[eager_method(method)]


def eager_method(method: str) -> str:
    """The method a compiled one runs compiled ("dflash-compiled" -> "dflash"); eager methods: themselves."""
    return method.removesuffix("-compiled")


def max_round_length(method: str, block_size: int) -> int:
    """The most tokens one verification round of `method` can commit (drafts + bonus)."""
    longest = {"plain": 1, "plain-alt": 1, "plain-packed": 1, "dflash": block_size, "builtin": block_size, "tree": block_size,
               "lookup": PROMPT_LOOKUP_NUM_TOKENS + 1}  # fmt: skip
    return longest.get(eager_method(method), max(block_size, PROMPT_LOOKUP_NUM_TOKENS + 1))  # hybrid: the deeper branch


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def static_cache_slots(method: str, drafter, prompt_length: int, max_new_tokens: int) -> int:
    """The StaticCache length of a compiled method's call: prompt + max_new_tokens + the most tokens a round
    verifies (room for a padded last round; trees and hybrid need it for every tree), rounded up to
    `STATIC_SLOT_MULTIPLE`. Each length is a graph."""
    base = eager_method(method)
    if base in ("plain", "plain-packed"):
        return static_slots(prompt_length + max_new_tokens)
    block = drafter.config.block_size
    nodes = max(AUTO_MAX_NODES, block) if base in TREE_METHODS else block
    width = nodes + PROMPT_LOOKUP_NUM_TOKENS if base in HYBRID_METHODS else nodes
    return static_slots(prompt_length + max_new_tokens, width)


def generate_with(
    method: str, target, drafter, inputs: dict[str, torch.Tensor], generation_kwargs: dict, slots: int | None = None
) -> Generation:
    """Run `target.generate(**inputs, **generation_kwargs)` with `method` and time it (wall clock). Compiled
    methods: a StaticCache of `slots` (default `static_cache_slots`)."""
    if method not in METHODS:
        raise ValueError(f"Unknown method {method!r}; known: {', '.join(METHODS)}.")
    prompt_length = inputs["input_ids"].shape[1]
    # Only the methods whose rounds are read off the forwards pay for the hook (a few µs per forward).
    recorder = ForwardRecorder(target) if method in ("builtin", "lookup") else nullcontext()
    timer = ForwardTimer(target) if method in (*HYBRID_METHODS, *TREE_METHODS) else nullcontext()
    packing = packed_linears(target) if method in PACKED_PLAIN_METHODS else nullcontext()
    counter = CompileCounter() if method in COMPILED_METHODS else nullcontext()
    tree_setting = getattr(drafter, "draft_tree", None) if drafter is not None else None
    if drafter is not None:  # only the tree methods draft trees
        drafter.draft_tree = TREE_SETTING if method in TREE_METHODS else None
    try:
        with recorder, timer, packing, counter:
            _synchronize(target.device)
            start = time.perf_counter()
            extra = method_kwargs(method, drafter)
            if method in COMPILED_METHODS:
                slots = slots or static_cache_slots(method, drafter, prompt_length, generation_kwargs["max_new_tokens"])
                extra |= compiled_generate_kwargs(target, slots, plain=method in PLAIN_METHODS)
            sequences = target.generate(**inputs, **generation_kwargs, **extra)
            _synchronize(target.device)
            seconds = time.perf_counter() - start
    finally:
        if drafter is not None:
            drafter.draft_tree = tree_setting
    branches = round_costs = block_sizes = None
    if method in PLAIN_METHODS:
        lengths = None
    elif method in OWN_LOOP_METHODS:
        lengths = list(drafter.last_acceptance.acceptance_lengths)
        block_sizes = list(drafter.last_acceptance.block_sizes)
    else:
        lengths = recorder.committed_per_forward(prompt_length, sequences.shape[1])
        if method == "builtin":
            lengths = lengths[1:]  # the prefill only produces the drafter's context features
    if method in (*HYBRID_METHODS, *TREE_METHODS):
        stats = drafter.last_acceptance
        branches = branch_tokens(stats) if method in HYBRID_METHODS else None
        # one forward per round after the prefill (the last ones: a first call also times the cost model); a
        # prefill that verified n-gram drafts is a round but not a tree forward like the others: left out
        sizes = stats.tree_sizes[1:] if stats.first_round_in_prefill else stats.tree_sizes
        forwards = timer.seconds[len(timer.seconds) - len(sizes) :] if sizes else []
        round_costs = [[size, forward] for size, forward in zip(sizes, forwards, strict=True)]
    return Generation(
        sequences=sequences,
        seconds=seconds,
        acceptance_lengths=lengths,
        block_sizes=block_sizes if eager_method(method) in ("dflash", "tree") else None,
        branches=branches,
        round_costs=round_costs,
        compiles=counter.count if method in COMPILED_METHODS else None,
    )
