"""Where a compiled DFlash round's time goes: verification, drafting and the loop, from one profiled generation.

Runs the shipped drafter's compiled loop (StaticCache + `compile_config`, as `hf-dflash bench`'s dflash-compiled)
on one GSM8K-style prompt, twice untimed (the compile), once timed with forward hooks on the drafter, once under
cProfile, and prints per round: the whole round, the compiled verification call, the packed products inside it
(oneDNN's `_linear_pointwise`) and the Python kernel of the op that carries them into the graph
(`hf_dflash::packed_linear`), the drafter's forward, and what is left (the loop's own work).

    python benchmarks/generation/compiled_round_profile.py --dtype bfloat16 --out out/compiled_round_profile.json

cProfile adds its own cost to every Python call, so the profiled run is slower than the timed one: its shares
place the time, the timed run gives the round.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from hf_dflash.checkpoints import load_drafter
from hf_dflash.generation.verifying.compiling import compiled_generate_kwargs
from hf_dflash.json_files import write_json_atomic
from hf_dflash.targets import load_target

PROMPT = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?"
)
# (label, a part of the profiled function's file, a part of its name): the rows read off the profile
PROFILE_ROWS = (
    ("compiled verification call", "_inductor/output_code.py", "__call__"),
    ("packed products (oneDNN)", "~", "torch._ops.mkldnn._linear_pointwise"),
    ("packed op's Python kernel", "packed_linears.py", "_packed_linear"),
    ("drafting (chain propose)", "generation/drafting/strategies/chain.py", "propose"),
)


def cumulative_seconds(stats: pstats.Stats, file_part: str, name_part: str) -> float:
    """The cumulative seconds of the first profiled function whose file and name hold these parts (0 if none)."""
    for (filename, _line, name), row in stats.stats.items():
        if file_part in filename and name_part in name:
            return row[3]
    return 0.0


def main(args: argparse.Namespace) -> None:
    target, tokenizer = load_target(dtype=args.dtype)
    drafter = load_drafter(args.drafter, dtype=target.dtype).eval()
    messages = [{"role": "user", "content": PROMPT}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]

    def generate() -> torch.LongTensor:
        kwargs = compiled_generate_kwargs(target, args.slots)
        return target.generate(
            ids, do_sample=False, max_new_tokens=args.max_new_tokens, assistant_model=drafter, **kwargs
        )

    generate(), generate()  # compile, then one warm call
    drafter_seconds = []
    start_of = {}
    drafter.register_forward_pre_hook(lambda *_: start_of.__setitem__("t", time.perf_counter()))
    drafter.register_forward_hook(lambda *_: drafter_seconds.append(time.perf_counter() - start_of["t"]))
    start = time.perf_counter()
    generate()
    seconds = time.perf_counter() - start
    rounds = len(drafter.last_acceptance.acceptance_lengths)
    profile = cProfile.Profile()
    profile.enable()
    generate()
    profile.disable()
    stats = pstats.Stats(profile)
    profiled_rounds = len(drafter.last_acceptance.acceptance_lengths)
    per_round = {
        label: 1000 * cumulative_seconds(stats, file_part, name_part) / profiled_rounds
        for label, file_part, name_part in PROFILE_ROWS
    }
    result = {
        "settings": vars(args),
        "threads": torch.get_num_threads(),
        "rounds": rounds,
        "tau": sum(drafter.last_acceptance.acceptance_lengths) / rounds,
        "round_ms": 1000 * seconds / rounds,
        "drafter_forward_ms": 1000 * sum(drafter_seconds) / len(drafter_seconds),
        "profiled_round_ms": 1000 * stats.total_tt / profiled_rounds,
        "profiled_per_round_ms": per_round,
    }
    print(
        f"{args.dtype}, {rounds} rounds (tau {result['tau']:.2f}), {ids.shape[1]}-token prompt, {args.slots} static slots"
    )
    print(f"round (timed run): {result['round_ms']:.1f} ms; drafter forward {result['drafter_forward_ms']:.1f} ms")
    print(f"profiled run, per round ({result['profiled_round_ms']:.1f} ms under cProfile):")
    for label, value in per_round.items():
        print(f"  {label:32s} {value:6.1f} ms")
    write_json_atomic(args.out, result)
    print(f"wrote {args.out}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default="models/smollm2-135m-instruct-dflash")
    parser.add_argument("--dtype", default="auto", help="target and drafter dtype (default: auto)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--slots", type=int, default=512, help="StaticCache length (the bench's for short prompts)")
    parser.add_argument("--out", default="out/compiled_round_profile.json")
    return parser.parse_args()


if __name__ == "__main__":
    main(parse_args())
