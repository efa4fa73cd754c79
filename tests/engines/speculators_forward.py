"""speculators' own forward on a drafter folder, run by tests/test_engines.py in the speculators virtualenv.

Reads a JSON request from argv[1]: {"drafter": folder in speculators' layout, "inputs": safetensors file with
"hidden_states" (1, T, n*H) (the target's features at aux_hidden_state_layer_ids), "input_ids" (1, T) and
"verifier_last_hidden_states" (1, T, H)}. Loads the folder with `SpeculatorModel.from_pretrained` (fp32, SDPA with
speculators' dense boolean mask: its default flex attention is compiled for GPUs) and runs its anchored-block
backbone with every position of the sequence but the last block_size as an anchor (all of them: speculators draws
its anchors at random, so asking for as many as there are valid positions makes the draw the full set). Writes to
argv[2] (safetensors): "hidden" (A*bs, H) after the final norm, "logits" (A*bs, draft vocabulary),
"block_indices" (A*bs,) (anchor a's block is positions anchor..anchor+bs-1), and the candidate selector's weights
as loaded ("state.candidate_selector.*", DFlash2). It imports only speculators: this package needs a newer
Transformers than speculators 0.9.0 pins.
"""

import json
import sys

import torch
from safetensors.torch import load_file, save_file


def load(folder: str):
    """The drafter as speculators loads it: the config class by speculators_model_type, the verifier's embedding
    and LM head read from speculators_config.verifier.name_or_path."""
    from speculators import SpeculatorModel, SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "sdpa"
    model = SpeculatorModel.from_pretrained(folder, config=config, dtype=torch.float32).eval()
    for name in ("embed_tokens.weight", "lm_head.weight", "fc.weight"):
        if model.state_dict()[name].isnan().any():
            raise SystemExit(f"{name} is NaN after loading: the verifier's weights were not found")
    return model


def main(request_path: str, out_path: str) -> None:
    request = json.loads(open(request_path).read())
    model = load(request["drafter"])
    inputs = load_file(request["inputs"])
    length = inputs["input_ids"].shape[1]
    with torch.no_grad():
        hidden, logits, _, _, block_indices = model._backbone_forward(
            inputs["hidden_states"],
            inputs["input_ids"],
            loss_mask=torch.ones(1, length, dtype=torch.long),
            verifier_last_hidden_states=inputs["verifier_last_hidden_states"],
            document_ids=torch.zeros(1, length, dtype=torch.long),
            max_anchors=length - model.block_size,
        )
    out = {"hidden": hidden[0], "logits": logits[0], "block_indices": block_indices}
    out |= {f"state.{key}": value for key, value in model.state_dict().items() if key.startswith("candidate_selector.")}
    save_file({key: value.contiguous() for key, value in out.items()}, out_path)
    print(f"speculators {model.config.speculators_model_type}: {len(block_indices) // model.block_size} anchors")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
