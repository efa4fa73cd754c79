"""A pruned draft vocabulary: the drafter computes only N rows of the target's LM head.

Oracles: logits equal the full head's at those ids (-inf elsewhere); greedy DFlash stays token-identical
to plain greedy and sampling keeps the target distribution (a proposal with zeros outside the subset
is valid); checkpoints round-trip in both formats; bad ids and sizes are named.
"""

import json

import pytest
import torch

from hf_dflash import DFlashConfig
from hf_dflash.checkpoints import load_drafter, load_official, save_hub, save_official
from tests.conftest import ARCHITECTURES, SUBSET, VOCAB, OracleDrafter, make_drafter, make_target, pruned_drafter
from tests.helpers.generation import check_sampled_second_token


def test_logits_are_the_full_heads_rows_and_minus_inf_elsewhere():
    target = make_target("llama")
    drafter = pruned_drafter(target)
    hidden = torch.randn(2, 3, target.config.hidden_size)
    full = target.lm_head(hidden)
    logits = drafter.draft_logits(hidden, target.lm_head)
    assert logits.shape == full.shape
    inside = torch.zeros(VOCAB, dtype=torch.bool)
    inside[SUBSET] = True
    torch.testing.assert_close(logits[..., inside], full[..., inside])
    assert torch.isneginf(logits[..., ~inside]).all()
    subset = drafter.draft_logits(hidden, target.lm_head, full_vocab=False)
    assert subset.shape == (2, 3, len(SUBSET)) and torch.equal(subset, logits[..., SUBSET])
    assert drafter.draft_token_ids.tolist() == SUBSET


def test_without_a_draft_vocabulary_the_head_is_used_as_is():
    target = make_target("llama")
    drafter = make_drafter(target)
    hidden = torch.randn(1, 2, target.config.hidden_size)
    assert torch.equal(drafter.draft_logits(hidden, target.lm_head), target.lm_head(hidden))
    assert drafter.draft_token_ids is None and "d2t" not in drafter.state_dict()


def test_a_changed_head_is_regathered():
    target = make_target("llama")
    drafter = pruned_drafter(target)
    hidden = torch.randn(1, 1, target.config.hidden_size)
    drafter.draft_logits(hidden, target.lm_head)
    with torch.no_grad():
        target.lm_head.weight.mul_(2)
    torch.testing.assert_close(
        drafter.draft_logits(hidden, target.lm_head)[..., SUBSET], target.lm_head(hidden)[..., SUBSET]
    )


@pytest.mark.parametrize("size", [0, VOCAB + 1, 2.5, "8"])
def test_bad_draft_vocab_size_is_named(size):
    with pytest.raises(ValueError, match=f"draft_vocab_size={size!r}"):
        DFlashConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            mask_token_id=3,
            num_target_layers=6,
            target_layer_ids=[1, 3],
            draft_vocab_size=size,
        )


@pytest.mark.parametrize(
    "ids,message",
    [
        (SUBSET[:-1], f"needs {len(SUBSET)} distinct"),
        (SUBSET[:-1] + [SUBSET[0]], "distinct"),
        (SUBSET[:-1] + [VOCAB], rf"\[0, vocab_size={VOCAB}\)"),
        (SUBSET[:-1] + [-1], "vocab_size"),
    ],
)
def test_bad_draft_vocab_ids_are_named(ids, message):
    drafter = make_drafter(make_target("llama"), draft_vocab_size=len(SUBSET))
    with pytest.raises(ValueError, match=message):
        drafter.set_draft_vocab(ids)


def test_full_vocabulary_drafter_refuses_a_subset():
    with pytest.raises(ValueError, match="draft_vocab_size=None"):
        make_drafter(make_target("llama")).set_draft_vocab(SUBSET)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
@pytest.mark.parametrize("block_size", [3, 8])
def test_greedy_with_a_pruned_vocabulary_equals_plain_greedy(arch, block_size):
    target = make_target(arch)
    drafter = pruned_drafter(target, block_size=block_size)
    prompt = torch.tensor([[5, 17, 33, 9, 71, 5, 17]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=20, eos_token_id=None)
    ours = target.generate(prompt, do_sample=False, max_new_tokens=20, eos_token_id=None, assistant_model=drafter)
    assert torch.equal(plain, ours)


def test_oracle_with_a_pruned_vocabulary_accepts_what_the_subset_holds():
    """Where the target's continuation lies inside the subset, whole blocks are accepted."""
    target = make_target("llama")
    prompt = torch.tensor([[5, 17, 33, 9, 71]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=24, eos_token_id=None)
    ids = sorted(set(plain[0].tolist()) | set(range(40)))
    config = make_drafter(target, block_size=4, draft_vocab_size=len(ids)).config
    oracle = OracleDrafter(config, target.lm_head.weight, plain).eval()
    oracle.set_draft_vocab(ids)
    ours = target.generate(prompt, do_sample=False, max_new_tokens=24, eos_token_id=None, assistant_model=oracle)
    assert torch.equal(plain, ours)
    assert oracle.last_acceptance.mean_acceptance_length > 3


def test_batched_greedy_with_a_pruned_vocabulary_equals_plain_batched():
    target = make_target("qwen3")
    drafter = pruned_drafter(target, block_size=4)
    batch = torch.tensor([[0, 0, 5, 17, 33], [9, 71, 5, 17, 2]])
    mask = (batch != 0).long()
    mask[1] = 1
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    assert torch.equal(target.generate(batch, **kwargs), target.generate(batch, assistant_model=drafter, **kwargs))


def test_sampling_with_a_pruned_vocabulary_preserves_the_target_distribution():
    target = make_target("qwen3", seed=3)
    check_sampled_second_token(target, pruned_drafter(target, block_size=4, seed=4), "pruned vocab generate(do_sample)")


@pytest.mark.parametrize("fmt", ["hub", "official"])
def test_checkpoints_carry_the_draft_vocabulary(tmp_path, fmt):
    target = make_target("llama")
    drafter = pruned_drafter(target)
    save_hub(drafter, tmp_path / fmt) if fmt == "hub" else save_official(drafter, tmp_path / fmt, target_lm_head=target)
    config = json.loads((tmp_path / fmt / "config.json").read_text())
    assert config["draft_vocab_size"] == len(SUBSET)
    loaded = load_drafter(tmp_path / fmt)
    assert loaded.draft_token_ids.tolist() == SUBSET
    hidden = torch.randn(1, 2, target.config.hidden_size)
    assert torch.equal(loaded.draft_logits(hidden, target.lm_head), drafter.draft_logits(hidden, target.lm_head))


@pytest.mark.parametrize("fmt", ["hub", "official"])
def test_a_corrupt_draft_vocabulary_is_refused_on_load(tmp_path, fmt):
    from safetensors.torch import load_file, save_file

    target = make_target("llama")
    drafter = pruned_drafter(target)
    save_hub(drafter, tmp_path / fmt) if fmt == "hub" else save_official(drafter, tmp_path / fmt, target_lm_head=target)
    weights = tmp_path / fmt / "model.safetensors"
    state = load_file(weights)
    state["d2t"][-1] = VOCAB  # the last id now points past the target vocabulary
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        (load_drafter if fmt == "hub" else load_official)(tmp_path / fmt)


@pytest.mark.parametrize("pruned", [True, False])
@pytest.mark.parametrize("batch", [1, 2])
def test_block_slices_take_one_product_not_a_batched_copy_of_the_head(pruned, batch):
    """The draft slots of a block are a slice (`hidden[:, 1:]`): aten's matmul ran such a 3-D input as a batched
    product over an expanded copy of the whole head (torch 2.13 CPU: 10x the product's time); rows are flattened
    first, so the head runs as one 2-D product, with the same logits, also for an empty slice."""
    target = make_target("llama")
    drafter = pruned_drafter(target) if pruned else make_drafter(target)
    block = torch.randn(batch, 5, target.config.hidden_size)
    for hidden in (block[:, 1:], block[:, 5:]):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            logits = drafter.draft_logits(hidden, target.lm_head, full_vocab=False)
        assert "aten::bmm" not in {event.key for event in profile.key_averages()}
        expected = target.lm_head(hidden.contiguous())
        assert logits.shape[:-1] == hidden.shape[:-1]
        torch.testing.assert_close(logits, expected[..., SUBSET] if pruned else expected)
