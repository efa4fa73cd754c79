"""vLLM's DFlash2 config parsing and weight loading on CPU, run by tests/test_engines.py in the engines virtualenv.

vLLM 0.32 drafts with a DFlash2 drafter only in its GPU model runner (V2); on CPU its engine config refuses it. What
runs on CPU is what its GPU speculator runs before drafting (`load_dflash_model`): the speculative config parsed from
the drafter folder (`SpeculativeConfig`: `dflash_config`, `target_layer_ids`, `mask_token_id`), the architecture
resolved by its registry, the model class built (`initialize_model`) and its weights loaded by the same loader
(`get_model_loader(...).load_weights`). Every parameter is set to NaN first, so one the checkpoint does not fill shows.

Reads a JSON request from argv[1]: {"target": folder, "drafter": official folder, "num_speculative_tokens": k};
writes to argv[2] {"serving_refusal": the engine config's error or null, "config": what vLLM parsed, "model_class",
"parameters": {vLLM name: shape}, "not_loaded": [vLLM names still NaN], "mismatched": [checkpoint names whose
vLLM parameter differs], "checked": number of checkpoint tensors compared}. It imports only vLLM.
"""

import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

STACKED = {".q_proj": (".qkv_proj", 0), ".k_proj": (".qkv_proj", 1), ".v_proj": (".qkv_proj", 2)}
STACKED.update({".gate_proj": (".gate_up_proj", 0), ".up_proj": (".gate_up_proj", 1)})


def engine_args(request: dict, speculative: bool):
    from vllm.engine.arg_utils import EngineArgs

    kwargs = dict(model=request["target"], dtype="float32", enforce_eager=True, max_model_len=512, seed=0)
    if speculative:
        kwargs["speculative_config"] = {
            "method": "dflash",
            "model": request["drafter"],
            "num_speculative_tokens": request["num_speculative_tokens"],
        }
    return EngineArgs(**kwargs)


def vllm_name(name: str) -> tuple[str, int | None]:
    """(vLLM parameter name, shard index or None) of checkpoint weight `name` (DFlashQwen3ForCausalLM.load_weights
    prefixes `model.`; DFlashQwen3Model's mapper stacks q/k/v and gate/up)."""
    name = name if name.startswith("lm_head") else "model." + name
    for old, (new, shard) in STACKED.items():
        if old in name:
            return name.replace(old, new), shard
    return name, None


def main(request_path: str, result_path: str) -> None:
    import torch
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.models.registry import ModelRegistry

    request = json.loads(open(request_path, encoding="utf-8").read())
    result = {"serving_refusal": None}
    try:  # what `vllm serve --speculative-config` builds first
        engine_args(request, speculative=True).create_engine_config()
    except ValueError as error:
        result["serving_refusal"] = str(error)

    vllm_config = engine_args(request, speculative=False).create_engine_config()
    speculative = engine_args(request, speculative=True).create_speculative_config(
        vllm_config.model_config, vllm_config.parallel_config
    )
    draft = speculative.draft_model_config
    model_class, _ = ModelRegistry.resolve_model_cls(draft.architectures, draft)
    result["config"] = {
        "method": speculative.method,
        "num_speculative_tokens": speculative.num_speculative_tokens,
        "hf_config_type": type(draft.hf_config).__name__,
        "architectures": list(draft.architectures),
        "dflash_config": dict(draft.hf_config.dflash_config),
        "vocab_size": draft.hf_config.vocab_size,
        "draft_vocab_size": getattr(draft.hf_config, "draft_vocab_size", None),
    }
    result["model_class"] = model_class.__name__

    # The engine config above refuses DFlash2 on CPU before it is built; the model is built on the target's config
    # with the parsed speculative config attached, as load_dflash_model builds it on a GPU.
    object.__setattr__(vllm_config, "speculative_config", speculative)
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"file://{tempfile.mkdtemp()}/init",
        )  # fmt: skip
        ensure_model_parallel_initialized(1, 1)
        model = initialize_model(vllm_config=vllm_config, model_config=draft)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.fill_(float("nan") if parameter.is_floating_point() else -1)
        get_model_loader(vllm_config.load_config).load_weights(model, draft)

    parameters = dict(model.named_parameters())
    result["parameters"] = {name: list(p.shape) for name, p in parameters.items()}
    result["not_loaded"] = sorted(
        name for name, p in parameters.items() if (p.isnan() if p.is_floating_point() else p < 0).any()
    )
    checkpoint = load_file(os.path.join(request["drafter"], "model.safetensors"))
    mismatched = []
    for name, tensor in checkpoint.items():
        target_name, shard = vllm_name(name)
        loaded = parameters.get(target_name)
        if loaded is None:
            mismatched.append(f"{name}: no vLLM parameter {target_name}")
            continue
        if shard is not None:  # the shard's rows, in the order the stacked mapping lists them
            sizes = [checkpoint[n].shape[0] for n in stacked_siblings(name, checkpoint)]
            loaded = loaded.split(sizes)[shard]
        if list(loaded.shape) != list(tensor.shape) or not torch.equal(loaded.float(), tensor.float()):
            mismatched.append(f"{name}: {list(tensor.shape)} vs {target_name} {list(loaded.shape)}")
    result["mismatched"], result["checked"] = mismatched, len(checkpoint)
    with open(result_path, "w", encoding="utf-8") as handle:
        json.dump(result, handle)


def stacked_siblings(name: str, checkpoint: dict) -> list[str]:
    """The checkpoint names stacked with `name` into one vLLM parameter, in shard order."""
    old = next(key for key in STACKED if key in name)
    group = [key for key, (new, _) in STACKED.items() if new == STACKED[old][0]]
    return [name.replace(old, key) for key in group if name.replace(old, key) in checkpoint]


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
