"""DFlash loop overhead per round on SmolLM2-135M-Instruct (CPU, bf16, 2 threads).

overhead per round = (time per round) - (drafter forward + target verification forward)

A round is the interval between the ends of two consecutive target forwards: it holds the previous
round's acceptance/commit/stop checks/cache crop, the drafting (feature concatenation, embedding,
drafter forward, draft LM head, argmax) and the verification forward. Forward times come from
forward pre/post hooks (time.perf_counter) on the drafter and the target; the draft LM head and
embedding calls made outside the target forward are timed too and reported apart, so the table
shows both "overhead" (everything but the two forwards, as defined above) and "glue" (overhead
minus the draft LM head and embedding: pure Python/tensor bookkeeping).

Plain greedy `target.generate` runs on the same prompt, interleaved with the DFlash runs.

    python benchmarks/generation/loop_overhead.py --reps 3 --out out/loop_overhead.json
    python benchmarks/generation/loop_overhead.py --breakdown   # + where the glue goes (one extra instrumented run)
    python benchmarks/generation/loop_overhead.py --profile out/loop_overhead.prof   # + cProfile of one DFlash run
    python benchmarks/generation/loop_overhead.py --force-tau 4   # drafts forced to the target's greedy text (tau = 4)

`--breakdown` profiles one more run (cProfile) and reads off the time of each step of the loop (the
functions of `hf_dflash.generation` that run it: `LOOP_STEPS`) and of the helpers they call; "the loop
between steps" is what is left of the overhead.

`--force-tau N` shows how the overhead scales with the acceptance length: the drafter and its LM head
still run, then (in this process only) the drafts are replaced: the first N-1 are the target's own
greedy continuation and the rest wrong. The continuation is taken
from a DFlash run with the same forcing, repeated until it reproduces itself (in bf16 a 16-token
verification may round a near-tie differently from plain decoding).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import hf_dflash
from hf_dflash.dtypes import describe_dtype
from hf_dflash.generation.drafting.block_drafter import BlockDrafter
from hf_dflash.targets import load_target

DEFAULT_PROMPT = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Explain every step in detail."
)


class ForwardTimer:
    """Records (start, end) perf_counter pairs of every forward call of a module through hooks.

    With `skip_while` set to another timer, calls made while that timer's module is running are
    ignored (e.g. the target's LM head inside the target forward).
    """

    def __init__(self, module: torch.nn.Module, skip_while: ForwardTimer | None = None):
        self.module = module
        self.skip_while = skip_while
        self.calls: list[tuple[float, float]] = []
        self.active = False
        self._start = 0.0
        self._handles: list = []

    def attach(self) -> ForwardTimer:
        self._handles = [
            self.module.register_forward_pre_hook(self._pre),
            self.module.register_forward_hook(self._post),
        ]
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def reset(self) -> None:
        self.calls = []

    def _pre(self, module, args) -> None:
        if self.skip_while is not None and self.skip_while.active:
            return
        self.active = True
        self._start = time.perf_counter()

    def _post(self, module, args, output) -> None:
        if not self.active:
            return
        self.calls.append((self._start, time.perf_counter()))
        self.active = False

    def total_between(self, start: float, end: float) -> float:
        """Seconds spent in calls that started within [start, end)."""
        return sum(e - s for s, e in self.calls if start <= s < end)


# Each step of a round: the functions that run it, as (a path ending, a function name) of cProfile's records.
LOOP_STEPS = {
    "propose": [("strategies/chain.py", "propose"), ("strategies/hybrid.py", "propose")],
    "verify": [("verifying/target_forward.py", "verify")],
    "accept": [("verifying/verdict.py", "judge")],
    "commit": [("rows.py", "commit")],
    "record_outputs": [("decoding.py", "record_outputs")],
    "rollback": [("target_slots.py", "keep"), ("drafting/block_drafter.py", "add_context")],
    "prune": [("target_slots.py", "prune"), ("drafting/block_drafter.py", "prune")],
}
HELPERS = {
    "process_rows": [("verifying/acceptance_rules.py", "process_rows")],
    "accepted_lengths": [("custom_generate.py", "accepted_lengths")],
    "count_until_stop": [("verifying/acceptance_rules.py", "count_until_stop")],
    "target_layer_features": [("target_features.py", "target_layer_features")],
    "row_copies": [("verifying/acceptance_rules.py", "row_copies")],
    "target.prepare_inputs_for_generation": [("generation/utils.py", "prepare_inputs_for_generation")],
    "Cache.crop (target and drafter)": [("cache_utils.py", "crop")],
}


def profiled_seconds(stats: pstats.Stats, functions: list[tuple[str, str]]) -> tuple[float, int]:
    """(cumulative seconds, calls) of the profiled functions named by (path ending, function name); functions
    that call one another are not both counted (none of a step's do)."""
    seconds = calls = 0
    for (path, _, name), (_, primitive_calls, _, cumulative, _) in stats.stats.items():
        if any(path.endswith(ending) and name == wanted for ending, wanted in functions):
            seconds += cumulative
            calls += primitive_calls
    return seconds, calls


def glue_breakdown(target, drafter, inputs, max_new_tokens: int, timers: dict[str, ForwardTimer]) -> dict:
    """One profiled DFlash run (cProfile: nothing of the loop is replaced): ms per verification round spent in
    each step of the loop and helper. The propose step's own lines exclude the drafter forward and the draft LM
    head/embedding; the verify step's exclude the target forward. Profiling slows Python itself down: the
    shares between steps are what this shows, not their absolute cost."""
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        run, _ = run_dflash(target, drafter, inputs, max_new_tokens, timers)
    finally:
        profiler.disable()
    stats = pstats.Stats(profiler)
    labelled = {f"step {step}": profiled_seconds(stats, found) for step, found in LOOP_STEPS.items()}
    labelled |= {f"  {name}": profiled_seconds(stats, found) for name, found in HELPERS.items()}
    rounds = max(run.rounds, 1)
    per_round = {label: 1e3 * seconds / rounds for label, (seconds, _) in labelled.items()}
    drafter_ms, head_ms, target_ms = mean(run.drafter_ms), mean(run.draft_head_ms), mean(run.target_ms)
    overhead = mean(run.round_ms) - drafter_ms - target_ms
    steps = {step: per_round.get(f"step {step}", 0.0) for step in LOOP_STEPS}
    own = dict(steps)
    own["propose"] -= drafter_ms + head_ms
    own["verify"] -= target_ms + 1e3 * run.prefill_s / rounds  # the prefill is the first verify step
    return {
        "rounds": run.rounds,
        "overhead_ms": overhead,
        "draft_lm_head_embed_ms": head_ms,
        "step_glue_ms": own,
        "helpers_ms": {k.strip(): v for k, v in per_round.items() if not k.startswith("step ")},
        "loop_inline_ms": overhead - head_ms - sum(own.values()),
        "calls": {label.strip(): calls for label, (_, calls) in labelled.items()},
    }


def print_breakdown(breakdown: dict) -> None:
    print(f"\nglue breakdown, ms per round ({breakdown['rounds']} rounds; overhead {breakdown['overhead_ms']:.2f} ms):")
    print(f"  {'draft LM head + embedding (kernels)':52s}{breakdown['draft_lm_head_embed_ms']:8.3f}")
    for step, ms in breakdown["step_glue_ms"].items():
        print(f"  {'step ' + step + ' (without the forwards)':52s}{ms:8.3f}")
    for label, ms in sorted(breakdown["helpers_ms"].items(), key=lambda item: -item[1]):
        print(f"    {label:50s}{ms:8.3f}")
    print(f"  {'the loop between steps':52s}{breakdown['loop_inline_ms']:8.3f}")


class ForcedDrafts:
    """Wraps `BlockDrafter.draft` so the drafts follow `reference` for tau - 1 slots, then go wrong (the
    drafter, its LM head and the argmax still run: the real cost)."""

    def __init__(self, tau: int):
        self.tau = tau
        self.reference: torch.Tensor | None = None  # (L,) full sequence, prompt included
        self._original = None

    def install(self) -> None:
        self._original = BlockDrafter.draft
        forced = self

        def draft(block, hidden, do_sample, logits_processor=None, batch_size=1, rows=None, prefixes=None):
            drafts = forced._original(block, hidden, do_sample, logits_processor, batch_size, rows, prefixes)
            return forced.force(drafts, len(prefixes[0]), block.lm_head.weight.shape[0])

        BlockDrafter.draft = draft

    def restore(self) -> None:
        if self._original is not None:
            BlockDrafter.draft = self._original
            self._original = None

    def force(self, drafts, start: int, vocab: int):
        count = drafts.tokens.shape[1]
        tokens = torch.zeros(count, dtype=torch.long)
        known = self.reference[start : start + count]
        tokens[: len(known)] = known
        tokens[self.tau - 1 :] = (tokens[self.tau - 1 :] + 1) % vocab  # deliberately wrong after tau - 1
        drafts.tokens = tokens[None].to(drafts.tokens.device)
        return drafts


def converge_reference(forced: ForcedDrafts, target, drafter, inputs, max_new_tokens: int, start: torch.Tensor) -> int:
    """Iterate reference -> forced DFlash output until it reproduces itself; returns the iterations used."""
    forced.reference = start
    for iteration in range(1, 6):
        with torch.inference_mode():
            output = target.generate(**inputs, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False)[
                0
            ]
        if torch.equal(output, forced.reference):
            return iteration
        forced.reference = output
    return iteration


@dataclass
class DFlashRun:
    wall_s: float
    new_tokens: int
    rounds: int
    mean_tau: float
    setup_s: float  # generate() start -> prefill forward start
    prefill_s: float  # the prompt's target forward
    tail_s: float  # last verification end -> generate() return
    round_ms: list[float] = field(default_factory=list)
    drafter_ms: list[float] = field(default_factory=list)
    draft_head_ms: list[float] = field(default_factory=list)  # draft LM head + block embedding
    target_ms: list[float] = field(default_factory=list)


@dataclass
class PlainRun:
    wall_s: float
    new_tokens: int
    setup_s: float
    prefill_s: float
    step_ms: list[float] = field(default_factory=list)  # interval between decode forward ends
    target_ms: list[float] = field(default_factory=list)  # decode forward time


def build_drafter(target, tokenizer, block_size: int, num_layers: int, seed: int) -> hf_dflash.DFlashDraftModel:
    torch.manual_seed(seed)
    config = hf_dflash.DFlashConfig.from_target_config(
        target.config, num_hidden_layers=num_layers, block_size=block_size, tokenizer=tokenizer
    )
    return hf_dflash.DFlashDraftModel(config).to(target.dtype).eval()  # the target's dtype (--dtype)


def run_dflash(
    target, drafter, inputs, max_new_tokens: int, timers: dict[str, ForwardTimer]
) -> tuple[DFlashRun, torch.Tensor]:
    for timer in timers.values():
        timer.reset()
    prompt_length = inputs["input_ids"].shape[1]
    with torch.inference_mode():
        start = time.perf_counter()
        output = target.generate(**inputs, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False)
        end = time.perf_counter()
    target_calls = timers["target"].calls
    taus = list(drafter.last_acceptance.acceptance_lengths)
    run = DFlashRun(
        wall_s=end - start,
        new_tokens=output.shape[1] - prompt_length,
        rounds=len(taus),
        mean_tau=sum(taus) / len(taus) if taus else 0.0,
        setup_s=target_calls[0][0] - start,
        prefill_s=target_calls[0][1] - target_calls[0][0],
        tail_s=end - target_calls[-1][1],
    )
    if len(target_calls) - 1 != len(taus):
        print(
            f"warning: {len(target_calls) - 1} verification forwards but {len(taus)} acceptance entries",
            file=sys.stderr,
        )
    for (_, previous_end), (verify_start, verify_end) in zip(target_calls, target_calls[1:]):
        run.round_ms.append(1e3 * (verify_end - previous_end))
        run.target_ms.append(1e3 * (verify_end - verify_start))
        run.drafter_ms.append(1e3 * timers["drafter"].total_between(previous_end, verify_start))
        head = timers["lm_head"].total_between(previous_end, verify_start)
        head += timers["embedding"].total_between(previous_end, verify_start)
        run.draft_head_ms.append(1e3 * head)
    return run, output[0, prompt_length:]


def run_plain(target, inputs, max_new_tokens: int, target_timer: ForwardTimer) -> tuple[PlainRun, torch.Tensor]:
    target_timer.reset()
    prompt_length = inputs["input_ids"].shape[1]
    with torch.inference_mode():
        start = time.perf_counter()
        output = target.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        end = time.perf_counter()
    calls = target_timer.calls
    run = PlainRun(
        wall_s=end - start,
        new_tokens=output.shape[1] - prompt_length,
        setup_s=calls[0][0] - start,
        prefill_s=calls[0][1] - calls[0][0],
    )
    for (_, previous_end), (step_start, step_end) in zip(calls, calls[1:]):
        run.step_ms.append(1e3 * (step_end - previous_end))
        run.target_ms.append(1e3 * (step_end - step_start))
    return run, output[0, prompt_length:]


def first_divergence(a: torch.Tensor, b: torch.Tensor) -> int | None:
    n = min(len(a), len(b))
    diff = (a[:n] != b[:n]).nonzero()
    if len(diff):
        return int(diff[0, 0])
    return None if len(a) == len(b) else n


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarise(dflash_runs: list[DFlashRun], plain_runs: list[PlainRun]) -> dict:
    """Per-repetition means, then the median and the best over repetitions (the best resists other load)."""
    per_rep = []
    for d, p in zip(dflash_runs, plain_runs):
        round_ms, drafter_ms, target_ms = mean(d.round_ms), mean(d.drafter_ms), mean(d.target_ms)
        head_ms = mean(d.draft_head_ms)
        per_rep.append(
            {
                "round_ms": round_ms,
                "drafter_ms": drafter_ms,
                "target_verify_ms": target_ms,
                "overhead_ms": round_ms - drafter_ms - target_ms,
                "draft_lm_head_embed_ms": head_ms,
                "glue_ms": round_ms - drafter_ms - target_ms - head_ms,
                "dflash_ms_per_token": 1e3 * d.wall_s / d.new_tokens,
                "plain_ms_per_token": 1e3 * p.wall_s / p.new_tokens,
                "plain_decode_forward_ms": mean(p.target_ms),
                "plain_step_overhead_ms": mean(p.step_ms) - mean(p.target_ms),
                "speedup": (p.wall_s / p.new_tokens) / (d.wall_s / d.new_tokens),
                "mean_tau": d.mean_tau,
                "rounds": d.rounds,
                "dflash_setup_ms": 1e3 * d.setup_s,
                "dflash_prefill_ms": 1e3 * d.prefill_s,
                "dflash_tail_ms": 1e3 * d.tail_s,
                "plain_setup_ms": 1e3 * p.setup_s,
                "plain_prefill_ms": 1e3 * p.prefill_s,
            }
        )
    keys = per_rep[0].keys()
    # "best": the fastest repetition of each time (least disturbed by other load); speedup from the
    # best times of each side; tau and rounds are not times (median).
    best = {k: min(r[k] for r in per_rep) for k in keys}
    best["speedup"] = best["plain_ms_per_token"] / best["dflash_ms_per_token"]
    for k in ("mean_tau", "rounds"):
        best[k] = statistics.median(r[k] for r in per_rep)
    return {
        "median": {k: statistics.median(r[k] for r in per_rep) for k in keys},
        "best": best,
        "per_rep": per_rep,
    }


def print_table(summary: dict, dflash_tokens: int, plain_tokens: int) -> None:
    med, low = summary["median"], summary["best"]
    rows = [
        ("DFlash ms/round (total)", "round_ms"),
        ("  drafter forward ms", "drafter_ms"),
        ("  target verify forward ms", "target_verify_ms"),
        ("  overhead ms (round - drafter - target)", "overhead_ms"),
        ("    of which draft LM head + embed ms", "draft_lm_head_embed_ms"),
        ("    of which glue ms", "glue_ms"),
        ("mean tau", "mean_tau"),
        ("DFlash ms/token", "dflash_ms_per_token"),
        ("plain greedy ms/token", "plain_ms_per_token"),
        ("  plain decode forward ms", "plain_decode_forward_ms"),
        ("  plain per-step overhead ms", "plain_step_overhead_ms"),
        ("speedup (plain / DFlash)", "speedup"),
        ("DFlash generate setup ms", "dflash_setup_ms"),
        ("DFlash prefill ms", "dflash_prefill_ms"),
        ("DFlash tail ms", "dflash_tail_ms"),
        ("plain generate setup ms", "plain_setup_ms"),
    ]
    print(f"\n{'':44s}{'median':>10s}{'best':>10s}")
    for label, key in rows:
        print(f"{label:44s}{med[key]:10.2f}{low[key]:10.2f}")
    print(f"(new tokens: DFlash {dflash_tokens}, plain {plain_tokens})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/loop_overhead.json")
    parser.add_argument("--reps", type=int, default=3, help="measured repetitions (plus one warm-up)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--draft-layers", type=int, default=3)
    parser.add_argument("--dtype", default="auto", help="auto (default): bf16 only with native CPU support")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=None, help="converted-target cache (default $HF_DFLASH_CACHE)")
    parser.add_argument(
        "--force-tau", type=int, default=0, help="force this acceptance length (0: the random drafter as is)"
    )
    parser.add_argument("--breakdown", action="store_true", help="also time each helper of the loop (one extra run)")
    parser.add_argument("--profile", default=None, help="also cProfile one DFlash run into this .prof file")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    target, tokenizer = load_target("smollm2-135m-instruct", dtype=args.dtype, cache_dir=args.cache_dir)
    drafter = build_drafter(target, tokenizer, args.block_size, args.draft_layers, args.seed)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": args.prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    target_timer = ForwardTimer(target).attach()
    timers = {
        "target": target_timer,
        "drafter": ForwardTimer(drafter).attach(),
        "lm_head": ForwardTimer(target.get_output_embeddings(), skip_while=target_timer).attach(),
        "embedding": ForwardTimer(target.get_input_embeddings(), skip_while=target_timer).attach(),
    }

    print(
        f"prompt {inputs['input_ids'].shape[1]} tokens, {args.threads} threads, {describe_dtype(args.dtype)}, "
        f"drafter {args.draft_layers} layers block {args.block_size}; load average {os.getloadavg()}"
    )
    run_dflash(target, drafter, inputs, args.max_new_tokens, timers)  # warm-up
    _, plain_warm = run_plain(target, inputs, args.max_new_tokens, target_timer)
    forced = None
    if args.force_tau:
        if not 1 <= args.force_tau <= args.block_size:
            parser.error(f"--force-tau must be in 1..{args.block_size}, got {args.force_tau}")
        forced = ForcedDrafts(args.force_tau)
        forced.install()
        start = torch.cat([inputs["input_ids"][0], plain_warm])
        iterations = converge_reference(forced, target, drafter, inputs, args.max_new_tokens, start)
        print(f"forced tau {args.force_tau}: reference converged after {iterations} run(s)")
    dflash_runs, plain_runs, loads = [], [], []
    for rep in range(args.reps):
        # Alternate the order so slow drifts (thermal, other load) hit both sides alike.
        order = ("dflash", "plain") if rep % 2 == 0 else ("plain", "dflash")
        for kind in order:
            if kind == "dflash":
                run, dflash_tokens = run_dflash(target, drafter, inputs, args.max_new_tokens, timers)
                dflash_runs.append(run)
            else:
                run, plain_tokens = run_plain(target, inputs, args.max_new_tokens, target_timer)
                plain_runs.append(run)
            loads.append(os.getloadavg()[0])
            print(f"rep {rep} {kind:6s}: {run.wall_s:6.2f} s, {run.new_tokens} tokens (load {loads[-1]:.2f})")

    summary = summarise(dflash_runs, plain_runs)
    print_table(summary, len(dflash_tokens), len(plain_tokens))
    divergence = first_divergence(dflash_tokens, plain_tokens)
    print(f"first divergence from plain greedy: {divergence} (bf16 near-ties may legitimately differ)")
    print("plain output:", repr(tokenizer.decode(plain_tokens)[:300]))

    breakdown = None
    if args.breakdown:
        breakdown = glue_breakdown(target, drafter, inputs, args.max_new_tokens, timers)
        print_breakdown(breakdown)

    if args.profile:
        for timer in timers.values():
            timer.detach()
        # (with --force-tau the forcing stays installed for the profiled run)
        profiler = cProfile.Profile()
        with torch.inference_mode():
            profiler.enable()
            target.generate(**inputs, assistant_model=drafter, max_new_tokens=args.max_new_tokens, do_sample=False)
            profiler.disable()
        Path(args.profile).parent.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(args.profile)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)

    if forced is not None:
        forced.restore()
    report = {
        "config": {
            **{k: v for k, v in vars(args).items() if k != "out"},
            "target": "smollm2-135m-instruct",
            "prompt_tokens": inputs["input_ids"].shape[1],
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "hf_dflash": hf_dflash.__version__,
            "machine": platform.platform(),
            "load_1min_after_each_run": loads,
        },
        "summary": summary,
        "dflash_new_tokens": len(dflash_tokens),
        "plain_new_tokens": len(plain_tokens),
        "first_divergence": divergence,
        "glue_breakdown": breakdown,
        "runs": {"dflash": [asdict(r) for r in dflash_runs], "plain": [asdict(r) for r in plain_runs]},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
