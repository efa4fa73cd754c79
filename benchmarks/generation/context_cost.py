"""The cost of a DFlash round against the context length: what grows with a long prompt, eager and compiled.

For each context length c in `--contexts` (default 256, 1024, 2048, 4096) and each mode in `--modes` (eager,
compiled), with the real target and drafter in the fast dtype of this machine (`--dtype auto`, bf16 where native):

- `step`: one plain decoding forward (1 token) after c cached tokens (eager: a DynamicCache; compiled: the forward
  through `torch.compile` over a StaticCache of the loop's length);
- `verify`: the target's verification forward of one block (B tokens, with the hidden states the drafter reads),
  its linear layers packed as the loop packs them (`drafter.linear_packing`, default "auto");
- `draft`: the drafter's pass as the loop runs it (`BlockDrafter`, packed alike: B new context features injected
  into its cache, the block, the draft head; eager in both modes), after c cached context features;
- `plain loop` and `round`: `generate` itself on a c-token prompt, plain and DFlash (the trained block every round),
  timed between consecutive streamer calls (one per plain step, one per DFlash round: everything a round does,
  cache crops, masks, acceptance, commit included); medians over `--new-tokens` tokens per call and `--reps` calls,
  plain and DFlash in turn;
- `glue` = round - verify - draft: the loop's own work per round.

The figure the issue asks for is `round / step`, the round's cost relative to a plain decoding step of the loop at
the same context, and its growth: (round / step at c) / (round / step at the first context). `tau` and `x plain`
(tau x step / round) tell whether the prompt's DFlash rounds beat plain decoding of the same mode (the prompt is
this repository's documentation cut to c tokens: its acceptance is not a chat's). The machine's load is read
before and after and recorded; timings under load are good for shares and ratios only (`--clock cpu`: this
process's CPU time on one thread, which other processes disturb far less than the wall clock).

    python benchmarks/generation/context_cost.py --out out/context_cost.json
    python benchmarks/generation/context_cost.py --clock cpu --modes eager --contexts 256,4096 --out out/cc.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import hf_dflash  # noqa: F401  (registers the generate hook)
from hf_dflash.bench.loading import machine_description
from hf_dflash.checkpoints import load_drafter
from hf_dflash.generation.linear_packing import loop_linear_packing
from hf_dflash.generation.policies.cost_timing import ServedRound
from hf_dflash.generation.verifying.compiling import compiled_generate_kwargs, static_cache, static_slots
from hf_dflash.json_files import write_json_atomic
from hf_dflash.machine_load import read_machine_load
from hf_dflash.targets import load_target

PROMPT_SOURCES = ("README.md", "docs/benchmarks.md", "docs/generation.md", "docs/results-history.md")
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock_now: Callable[[], float] = time.perf_counter  # `--clock`


class Clock:
    """A streamer that only records when each `put` comes (one per plain step, one per DFlash round) and how many
    tokens it brings."""

    def __init__(self):
        self.times: list[float] = []
        self.tokens: list[int] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(clock_now())
        self.tokens.append(value.numel())

    def end(self) -> None:
        pass

    def steady(self) -> tuple[list[float], list[int]]:
        """(seconds, tokens) of the rounds after the first two puts (the prompt or prefill, and the first round,
        which in compiled mode holds the warm-up of the rounds' graphs)."""
        return [b - a for a, b in zip(self.times[2:], self.times[3:])], self.tokens[3:]


def prompt_ids(tokenizer, length: int) -> torch.LongTensor:
    """(1, length) token ids of this repository's documentation, repeated as needed."""
    root = Path(__file__).resolve().parents[2]
    text = "\n\n".join((root / name).read_text(encoding="utf-8") for name in PROMPT_SOURCES if (root / name).exists())
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    return ids.repeat(-(-length // len(ids)))[:length][None]


def median_seconds(run: Callable[[], None], reps: int) -> float:
    run()
    times = []
    for _ in range(reps):
        start = clock_now()
        run()
        times.append(clock_now() - start)
    return statistics.median(times)


@torch.no_grad()
def eager_components(target, drafter, context: int, reps: int) -> dict:
    """Seconds of a plain step, a B-token verification and the drafter's pass after `context` tokens (eager)."""
    block = drafter.config.block_size
    served = ServedRound(target, drafter, 1, context)
    ids = served.token_ids
    row = {"step": median_seconds(lambda: served.target_pass(ids[:, :1]), reps)}
    with loop_linear_packing(target, drafter):  # as the loop runs its rounds (plain decoding: unpacked)
        row["verify"] = median_seconds(lambda: served.target_pass(ids[:, :block]), reps)
        row["draft"] = median_seconds(lambda: served.draft(block), reps)
    return row


@torch.no_grad()
def compiled_components(target, drafter, context: int, slots: int, reps: int) -> dict:
    """Seconds of a compiled plain step and a compiled B-token verification after `context` tokens, over a
    StaticCache of `slots` (its write position rewound after each pass); the drafter's pass is eager."""
    block, hidden_request = drafter.config.block_size, [i + 1 for i in drafter.config.target_layer_ids]
    vocab = target.get_input_embeddings().num_embeddings
    ids = (torch.arange(context + block) * 7919 % vocab)[None]
    cache = static_cache(target, slots)
    target(input_ids=ids[:, :context], cache=cache, cache_position=torch.arange(context), use_cache=True)
    forward = torch.compile(target.forward, dynamic=False)

    def one_pass(n: int) -> None:
        positions = torch.arange(context, context + n)
        forward(input_ids=ids[:, context : context + n], cache=cache, cache_position=positions,
                position_ids=positions[None], use_cache=True, output_hidden_states=hidden_request)  # fmt: skip
        cache.crop(-n)

    row = {"step": median_seconds(lambda: one_pass(1), reps)}
    with loop_linear_packing(target, drafter):
        row["verify"] = median_seconds(lambda: one_pass(block), reps)
    return row


def loop_timings(target, drafter, prompt: torch.LongTensor, args, compiled: bool) -> dict:
    """Median seconds per plain step and per DFlash round of `generate` on `prompt` (1, c), calls in turn (the
    first of each untimed: compiled, it compiles the cache length's graphs), and DFlash's tokens per round."""
    new, block = args.new_tokens, drafter.config.block_size
    clocks: dict[str, list] = {"plain": [[], []], "dflash": [[], []]}
    for rep in range(args.reps + 1):
        for name in ("plain", "dflash"):
            extra = {"assistant_model": drafter} if name == "dflash" else {}
            if compiled:
                slots = static_slots(prompt.shape[1] + new, block if name == "dflash" else 0)
                extra |= compiled_generate_kwargs(target, slots, plain=name == "plain")
            clock = Clock()
            target.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                            do_sample=False, eos_token_id=None, streamer=clock, **extra)  # fmt: skip
            if rep:
                seconds, tokens = clock.steady()
                clocks[name][0] += seconds
                clocks[name][1] += tokens
    return {
        "plain_step": statistics.median(clocks["plain"][0]),
        "round": statistics.median(clocks["dflash"][0]),
        "tau": statistics.mean(clocks["dflash"][1]),
    }


def measure(target, drafter, tokenizer, args) -> dict:
    """{mode: {context: figures}} for every mode and context length asked for."""
    results: dict = {mode: {} for mode in args.modes}
    for context in args.contexts:
        prompt = prompt_ids(tokenizer, context)
        eager = eager_components(target, drafter, context, args.component_reps)
        for mode in args.modes:
            row = dict(eager)
            if mode == "compiled":
                slots = static_slots(context + args.new_tokens, drafter.config.block_size)
                row |= compiled_components(target, drafter, context, slots, args.component_reps)
            row |= loop_timings(target, drafter, prompt, args, compiled=mode == "compiled")
            row["glue"] = row["round"] - row["verify"] - row["draft"]
            results[mode][context] = row
            print_row(mode, context, row, results[mode][args.contexts[0]])
    return results


def print_row(mode: str, context: int, row: dict, first: dict) -> None:
    ratio, first_ratio = row["round"] / row["plain_step"], first["round"] / first["plain_step"]
    ms = {key: f"{1000 * row[key]:.1f}" for key in ("step", "verify", "draft", "glue", "plain_step", "round")}
    shares = " / ".join(f"{100 * row[key] / row['round']:.0f}%" for key in ("verify", "draft", "glue"))
    print(
        f"| {mode} | {context} | {ms['step']} | {ms['verify']} | {ms['draft']} | {ms['glue']} | {ms['plain_step']} | "
        f"{ms['round']} | {shares} | {ratio:.2f} | {ratio / first_ratio:.2f} | {row['tau']:.2f} | "
        f"{row['tau'] * row['plain_step'] / row['round']:.2f} |",
        flush=True,
    )


HEADER = (
    "| mode | context | step ms | verify ms | draft ms | glue ms | plain loop ms/step | round ms | "
    "verify / draft / glue of a round | round / step | vs first context | tau | x plain |\n" + "|---" * 13 + "|"
)


def main(args: argparse.Namespace) -> None:
    global clock_now
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"context_cost.py: error: {out} exists; choose another --out or remove it")
    clock_now = CLOCKS[args.clock]
    if args.clock == "cpu":
        torch.set_num_threads(1)  # this process's CPU time is then the work done, not the waits for other processes
    torch._dynamo.config.recompile_limit = 64  # a few graphs per context length, all of `target.forward`
    target, tokenizer = load_target(args.target, dtype=args.dtype)
    drafter = load_drafter(args.drafter, dtype=target.dtype).eval()
    drafter.block_size_policy = drafter.config.block_size  # the trained block every round: rounds alike
    load_before = read_machine_load().record()
    print(
        f"{args.target} + {args.drafter}, {target.dtype}, block {drafter.config.block_size}; machine load {load_before}"
    )
    print(HEADER)
    results = measure(target, drafter, tokenizer, args)
    record = {
        "machine": machine_description(target.device),
        "settings": {**vars(args), "dtype": str(target.dtype).removeprefix("torch.")},
        "load_before": load_before,
        "load_after": read_machine_load().record(),
        "seconds": results,
    }
    write_json_atomic(out, record)
    print(f"wrote {out}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--drafter", default="models/smollm2-135m-instruct-dflash")
    parser.add_argument("--dtype", default="auto", help="auto: bf16 where the CPU multiplies it natively, else fp32")
    parser.add_argument("--contexts", type=lambda t: [int(x) for x in t.split(",")], default=[256, 1024, 2048, 4096])
    parser.add_argument("--modes", type=lambda t: t.split(","), default=["eager", "compiled"])
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens per generate call")
    parser.add_argument("--reps", type=int, default=3, help="timed generate calls per method and context")
    parser.add_argument("--component-reps", type=int, default=9, help="timed calls per component forward")
    parser.add_argument(
        "--clock",
        choices=tuple(CLOCKS),
        default="wall",
        help="wall: perf_counter (a quiet machine); cpu: this process's CPU time on 1 thread (a loaded machine: "
        "the shares and ratios survive other processes, the milliseconds are not a user's)",
    )
    parser.add_argument("--out", default="out/context_cost.json")
    return parser.parse_args()


if __name__ == "__main__":
    main(parse_args())
