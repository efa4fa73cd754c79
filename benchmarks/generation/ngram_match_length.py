"""Which n-gram match gives the best copy drafts? τ of n-gram drafting alone, per set, by rule.

Generates SmolLM2-135M-Instruct's greedy answers once (bf16), then walks each answer as serving does:
at the current position draft up to `--num-tokens` tokens with a rule, accept the drafts that equal the
answer, commit them + 1 token (the bonus), and move on. τ = mean tokens committed per round (no timing:
this measures the drafts, not the machine). Rules: Transformers' prompt lookup (first occurrence of the
suffix n-gram, n <= 2, stops at the text's end) and `hf_dflash.generation.drafting.ngram.ngram_match`
(latest occurrence of the longest suffix n-gram, n <= cap, overlapping copy) for several caps.

    python benchmarks/generation/ngram_match_length.py --num-prompts 3 --out out/ngram_match_length.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from hf_dflash.bench.loading import load_bench_models
from hf_dflash.bench.prompts import load_prompt_sets
from hf_dflash.bench.runner import chat_inputs
from hf_dflash.generation.drafting.ngram import ngram_match

CAPS = (1, 2, 3, 4, 8, 16)


def first_occurrence(tokens: list[int], max_ngram_size: int, num_tokens: int) -> list[int]:
    """Transformers' `PromptLookupCandidateGenerator` rule (without its logits-processor filter)."""
    for n in range(min(max_ngram_size, len(tokens) - 1), 0, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + num_tokens]
    return []


def walk(tokens: list[int], prompt_length: int, draft: Callable[[list[int]], list[int]]) -> float:
    """τ of drafting the answer tokens[prompt_length:] round by round with `draft`."""
    position, rounds, committed = prompt_length, 0, 0
    while position < len(tokens):
        drafts = draft(tokens[:position])
        accepted = 0
        while (
            accepted < len(drafts)
            and position + accepted < len(tokens)
            and drafts[accepted] == tokens[position + accepted]
        ):
            accepted += 1
        step = min(accepted + 1, len(tokens) - position)
        rounds, committed, position = rounds + 1, committed + step, position + step
    return committed / rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="code-edit,gsm8k,humaneval,mt-bench,alpaca-eval")
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--num-tokens", type=int, default=10, help="drafts per round (prompt_lookup_num_tokens)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="out/ngram_match_length.json")
    args = parser.parse_args()

    models = load_bench_models("smollm2-135m-instruct", "random", dtype="bfloat16")
    prompt_sets = load_prompt_sets(args.sets.split(","), None, args.num_prompts, args.seed)
    answers = []
    for name, records in prompt_sets.items():
        for record in records:
            inputs = chat_inputs(models.tokenizer, record["messages"][:1], models.target.device)
            output = models.target.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
                                            pad_token_id=models.tokenizer.eos_token_id)  # fmt: skip
            answers.append((name, inputs["input_ids"].shape[1], output[0].tolist()))

    m = args.num_tokens
    rules = {"transformers first n<=2": lambda tokens: first_occurrence(tokens, 2, m)}
    for cap in CAPS:
        rules[f"latest longest n<={cap}"] = lambda tokens, cap=cap: ngram_match(torch.tensor(tokens), cap, m)[
            0
        ].tolist()
    table = {}
    for rule, draft in rules.items():
        per_set: dict[str, list[float]] = {}
        for name, prompt_length, tokens in answers:
            per_set.setdefault(name, []).append(walk(tokens, prompt_length, draft))
        table[rule] = {name: sum(values) / len(values) for name, values in per_set.items()}
    names = list(prompt_sets)
    print(f"τ of n-gram drafting alone ({m} drafts/round), mean over {args.num_prompts} greedy answers per set")
    print(f"{'rule':26}" + "".join(f"{name:>13}" for name in names))
    for rule, row in table.items():
        print(f"{rule:26}" + "".join(f"{row[name]:13.2f}" for name in names))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"settings": vars(args), "tau": table}, indent=2) + "\n")
    print(f"Wrote {args.out}")


if __name__ == "__main__":
    main()
