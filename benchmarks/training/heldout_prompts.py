"""Write the first user turn of each held-out chat as an `hf-dflash bench --prompts` file.

`heldout_tau.py` predicts the τ serving gets on held-out chats; the bench measures it. On the same prompts
the two meet (v5, fp32, the first 64 chats of part 2: bench 2.31 served over 128 new tokens, estimate 2.34
with `--reply-tokens 128`), so a gap between held-out and unseen prompts is the prompts', not the tool's:

    python benchmarks/training/heldout_prompts.py --eval-part regen-bf16-part2 --samples 64 \\
        --out out/heldout_part2.jsonl
    hf-dflash bench --drafter models/smollm2-135m-instruct-dflash --prompts out/heldout_part2.jsonl \\
        --num-prompts 0 --methods dflash --dtype float32 --block-size-policy trained --max-new-tokens 128

The user text is read back from the chats' token ids through the target's ChatML turns (SmolLM2, Qwen).
"""

import argparse
import json
import re
from pathlib import Path

from hf_dflash.targets import load_target
from hf_dflash.trainer.heldout import held_out_samples

USER_TURN = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.S)


def first_user_turn(text: str) -> str:
    """The first ChatML user turn of a decoded chat; ValueError for a chat in another template."""
    match = USER_TURN.search(text)
    if match is None:
        raise ValueError(f"no ChatML user turn in {text[:80]!r}...: this script reads ChatML chats (SmolLM2, Qwen).")
    return match.group(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/smollm2-135m-instruct", help="packed folder (default: %(default)s)")
    parser.add_argument("--eval-part", default=None, help="hold out the first --samples chats of this part")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--target", default="smollm2-135m-instruct", help="whose tokenizer decodes the chats")
    parser.add_argument("--out", required=True, help="JSONL to write ({'id', 'messages'} per line)")
    args = parser.parse_args()
    _, tokenizer = load_target(args.target)
    rows = [
        {
            "id": sample["id"],
            "messages": [{"role": "user", "content": first_user_turn(tokenizer.decode(sample["input_ids"]))}],
        }
        for sample in held_out_samples(args.data, args.samples, args.eval_part)
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    print(f"Wrote {len(rows)} prompts to {args.out}")


if __name__ == "__main__":
    main()
