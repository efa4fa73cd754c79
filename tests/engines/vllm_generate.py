"""Greedy generation with vLLM (its CPU build), run by tests/test_engines.py in the engines virtualenv.

Reads a JSON request from argv[1]: {"target": folder, "runs": {name: official drafter folder or null (no
speculation)}, "prompts": [[ids]], "max_tokens": n, "num_speculative_tokens": k, "dtype": "float32"}; writes to
argv[2] {name: {"outputs": [[ids]], "num_drafts", "num_draft_tokens", "num_accepted_tokens",
"accepted_per_position": [...], "seconds"}}, one engine after the other in this process.
It imports only vLLM: this package needs a newer Transformers than vLLM 0.32 pins.
"""

import json
import os
import sys
import time

# One process, a small KV cache: what a 2-core machine holds (the test sets these too).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")


def counters(llm) -> dict:
    """The speculative-decoding counters of the engine's metrics snapshot."""
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_position": []}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in out and hasattr(metric, "value"):
            out[name] = metric.value
        elif name == "num_accepted_tokens_per_pos":
            out["accepted_per_position"] = list(metric.values)
    return out


def run(request: dict, drafter: str | None) -> dict:
    """Greedy outputs of every prompt, one at a time (batch 1), and the engine's speculative counters."""
    import gc

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=request["target"], dtype=request["dtype"], enforce_eager=True, disable_log_stats=False)
    kwargs.update(max_model_len=request.get("max_model_len", 2048), seed=0)
    if drafter:
        kwargs["speculative_config"] = {
            "method": "dflash",
            "model": drafter,
            "num_speculative_tokens": request["num_speculative_tokens"],
        }
    start = time.perf_counter()
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
    ready = time.perf_counter()
    outputs = [llm.generate([prompt], params, use_tqdm=False)[0] for prompt in prompts]
    result = {"outputs": [list(out.outputs[0].token_ids) for out in outputs]}
    result.update(start_seconds=ready - start, generate_seconds=time.perf_counter() - ready, **counters(llm))
    del llm
    gc.collect()
    return result


def main(request_path: str, result_path: str) -> None:
    request = json.loads(open(request_path, encoding="utf-8").read())
    results = {name: run(request, drafter) for name, drafter in request["runs"].items()}
    with open(result_path, "w", encoding="utf-8") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
