"""What compiling plain decoding costs on CPU, with inductor's on-disk cache cold and warm.

`--compile auto` stays eager on CPU because a cache length's first compiled call costs tens of seconds. torch
keeps compiled graphs on disk (inductor's FX graph cache, `TORCHINDUCTOR_CACHE_DIR`, by default
/tmp/torchinductor_$USER), so a second process compiles the same shapes from that cache. This script times,
each in a fresh process: the first and a second compiled `generate` call with an empty cache folder (cold),
then the same in a new process over the filled folder (warm), and eager calls for reference.

    python benchmarks/generation/compile_cost.py --dtype bfloat16 --out out/compile_cost.json

Prints a table and writes JSON (`first_call_s`, `steady_call_s` per run; the compile cost is first - steady).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "Write a haiku about the sea."


def one_run(compiled: bool, dtype: str, new_tokens: int) -> dict:
    """In this process: two timed greedy `generate` calls of `new_tokens` tokens (compiled or eager)."""
    from hf_dflash.generation.verifying.compiling import compiled_generate_kwargs, static_slots
    from hf_dflash.targets import load_target

    target, tokenizer = load_target("smollm2-135m-instruct", dtype=dtype)
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    seconds = []
    for _ in range(2):
        extra = (
            compiled_generate_kwargs(target, static_slots(inputs["input_ids"].shape[1] + new_tokens))
            if compiled
            else {}
        )
        start = time.perf_counter()
        target.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **extra)
        seconds.append(time.perf_counter() - start)
    return {"first_call_s": round(seconds[0], 2), "steady_call_s": round(seconds[1], 2), "dtype": str(target.dtype)}


def in_fresh_process(compiled: bool, dtype: str, new_tokens: int, cache_dir: str) -> dict:
    command = [sys.executable, __file__, "--child", "compiled" if compiled else "eager", "--dtype", dtype]
    command += ["--new-tokens", str(new_tokens)]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    output = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", default="out/compile_cost.json")
    parser.add_argument("--child", choices=("compiled", "eager"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_run(args.child == "compiled", args.dtype, args.new_tokens)))
        return
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache_dir:
        runs = {
            "eager": in_fresh_process(False, args.dtype, args.new_tokens, cache_dir),
            "compiled, cold cache": in_fresh_process(True, args.dtype, args.new_tokens, cache_dir),
            "compiled, warm cache": in_fresh_process(True, args.dtype, args.new_tokens, cache_dir),
        }
    print(f"{args.new_tokens} new tokens per call, {runs['eager']['dtype']}, fresh process per row\n")
    print("| run | first call (s) | second call (s) | compile (s) |\n|---|---|---|---|")
    for name, run in runs.items():
        run["compile_s"] = round(run["first_call_s"] - run["steady_call_s"], 2)
        print(f"| {name} | {run['first_call_s']} | {run['steady_call_s']} | {run['compile_s']} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"settings": vars(args) | {"child": None}, "runs": runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
