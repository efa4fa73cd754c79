"""Drafters with sliding-window layers (issue 53, item 1): the drafter's own cache rolls its block back once the
context passes the window, as the target's does (past recording), and a cached pass attends to exactly the keys a
cache-free forward over the whole context attends to. Layouts: z-lab's (every layer sliding, window 16,
bidirectional in the block), a DFlash2 drafter with sliding layers, one sliding layer of window 4 (causal or
bidirectional in the block). Greedy output equals plain greedy token for token (fp32) in every loop: the
package's, the folder's `custom_generate` and Transformers' assisted loop (`speculation_type="dflash"`)."""

import pytest
import torch

from hf_dflash.modeling_dflash.custom_generate import dflash_decoding, drafter_cache, drafter_pass
from tests.conftest import make_drafter, make_target
from tests.helpers.generation import plain_greedy, prompt

SLIDING = "sliding_attention"
DFLASH2 = dict(conv_kernel_size=2, conv_group_size=8, selector_rank=6, selector_top_k=4)
# name: (block size, drafter config overrides)
LAYOUTS = {
    "zlab_all_sliding_16_bidirectional": (
        16,
        dict(layer_types=[SLIDING, SLIDING], sliding_window=16, sliding_window_non_causal=True),
    ),
    "dflash2_sliding_8": (4, dict(layer_types=[SLIDING, SLIDING], sliding_window=8, **DFLASH2)),
    "one_sliding_4_causal": (4, dict(layer_types=["full_attention", SLIDING], sliding_window=4)),
    "one_sliding_4_bidirectional": (
        4,
        dict(layer_types=[SLIDING, "full_attention"], sliding_window=4, sliding_window_non_causal=True),
    ),
}
PROMPT, NEW_TOKENS = 12, 30


def sliding_drafter(target, name: str):
    block_size, overrides = LAYOUTS[name]
    drafter = make_drafter(target, block_size=block_size, **overrides)
    if drafter.config.is_dflash2:  # move the convolutions and the selector off identity, so they take part
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for parameter_name, parameter in drafter.named_parameters():
                if "_conv." in parameter_name or parameter_name.startswith("candidate_selector."):
                    parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    return drafter


def run(loop: str, target, drafter, input_ids):
    kwargs = dict(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None)
    if loop == "package":
        return target.generate(input_ids, assistant_model=drafter, **kwargs)
    if loop == "transformers":  # Transformers' assisted loop (its DFlash cache records the past; the mask must follow)
        return target.generate(input_ids, assistant_model=drafter, speculation_type="dflash", **kwargs)
    return target.generate(input_ids, custom_generate=dflash_decoding, dflash_drafter=drafter, **kwargs)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("loop", ["package", "custom_generate", "transformers"])
def test_generation_past_the_drafter_window_matches_plain_greedy(loop, name):
    target = make_target("qwen3")
    drafter = sliding_drafter(target, name)
    input_ids = prompt(4, length=PROMPT)
    expected = plain_greedy(target, input_ids, max_new_tokens=NEW_TOKENS, eos_token_id=None)
    assert torch.equal(run(loop, target, drafter, input_ids), expected)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_cached_passes_equal_a_cache_free_forward_over_the_whole_context(name):
    """Rounds of `drafter_pass` on the drafter's cache (new context 11, 3, 1, 4, 2, 6 tokens: past every window)
    give the block outputs of one forward without cache over all the context so far (fp32, < 1e-5)."""
    target = make_target("qwen3")
    drafter = sliding_drafter(target, name)
    block_size = drafter.config.block_size
    embedding = target.get_input_embeddings()
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(1, 40, drafter.fc.in_features, generator=generator)
    bonus_tokens = torch.randint(3, 100, (10,), generator=generator)
    cache, seen = drafter_cache(drafter.config), 0
    with torch.no_grad():
        for round_index, new in enumerate([11, 3, 1, 4, 2, 6]):
            bonus = bonus_tokens[round_index : round_index + 1]
            positions = torch.arange(seen, seen + new + block_size)[None]
            cached = drafter_pass(
                drafter, embedding, cache, bonus, features[:, seen : seen + new], positions, block_size
            )
            seen += new
            block = torch.full((1, block_size), drafter.config.mask_token_id)
            block[:, 0] = bonus
            whole = drafter(noise_embeds=embedding(block), context_hidden_states=features[:, :seen]).last_hidden_state
            assert cache.get_seq_length() == seen
            assert (cached - whole[:, 1:]).abs().max() < 1e-5, (round_index, seen)
