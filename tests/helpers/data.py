"""Helpers shared by the data tests: the character-level ChatML tokenizer of the tiny model, messages,
prompt files and tiny model folders for CLI tests, an eval suite, tiny regeneration, loss-mask runs, and
tokenised samples for the packed data."""

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from hf_dflash.data import sources
from hf_dflash.data.regenerate import regenerate_responses
from tests.conftest import VOCAB, make_drafter, make_target

# --- data preparation ---


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_char_tokenizer(chat_template: str = CHATML) -> PreTrainedTokenizerFast:
    """One token per character (ASCII + Latin-1 filler up to the tiny model's vocab) and ChatML specials."""
    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]  # ids 0, 1, 2 = conftest's pad, bos, eos
    chars = ["\n"] + [chr(code) for code in range(32, 127)]
    chars += [chr(code) for code in range(161, 161 + VOCAB - len(specials) - len(chars))]
    backend = Tokenizer(
        models.BPE(vocab={token: i for i, token in enumerate(specials + chars)}, merges=[], unk_token="<unk>")
    )
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<unk>"
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def save_tiny_folders(root: Path) -> tuple[Path, Path]:
    """(target folder with the character tokenizer, block-4 random drafter folder) under `root`, for CLI tests."""
    target = make_target("llama")
    target.save_pretrained(root / "target")
    make_char_tokenizer().save_pretrained(root / "target")
    make_drafter(target, block_size=4).save_pretrained(root / "drafter")
    return root / "target", root / "drafter"


def write_lines(path: Path, rows) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


EVAL_QUESTION = (
    "A farmer has seventeen sheep and buys nine more at the market every single week of the year. How many apples?"
)


EVAL_SUITE = {
    "toy-math": [{"id": "toy-math:7", "source": "toy-math", "messages": [user(sources.math_prompt(EVAL_QUESTION))]}],
    "toy-code": [
        {"id": "toy-code:3", "source": "toy-code", "messages": [user("Write a function to add two numbers.")]}
    ],
}


PROMPTS = [
    {
        "id": f"p{i}",
        "source": "toy",
        "messages": [user(f"Question {i}: " + "why? " * i)] + ([user("And then?")] if i % 3 == 0 else []),
    }
    for i in range(7)
]


def regenerate_tiny(out_dir, prompts=PROMPTS, **overrides):
    settings = dict(temperature=1.0, max_new_tokens=5, batch_size=2, shard_size=3, seed=3, progress=False)
    return regenerate_responses(
        make_target("llama"), make_char_tokenizer(), prompts, out_dir, **{**settings, **overrides}
    )


def masked_runs(input_ids, loss_mask):
    runs, current = [], []
    for token, supervised in zip(input_ids, loss_mask):
        if supervised:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


# --- packed data ---


def write_tokenized(folder, name, samples):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("".join(json.dumps(s) + "\n" for s in samples))


def sample(i, source="gsm8k"):
    return {"id": f"{source}:{i}", "input_ids": [1 + i, 70, 71, 2], "loss_mask": [0, 1, 1, 1]}


SETTINGS = {"dtype": "bfloat16", "max_new_tokens": 384}
