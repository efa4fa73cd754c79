"""Worker for the recipe's Ctrl-C test: `hf-dflash recipe ARGS...` with the tiny eval suite, where (with
SWALLOW_INTERRUPTS=1) the target's generation swallows a KeyboardInterrupt and carries on, as a finalizer or a
library's broad `except` can ("Exception ignored in ..."). Prints "regenerating" when the first reply batch starts.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_dflash.cli import main  # noqa: E402
from hf_dflash.data import corpus, regenerate  # noqa: E402
from tests.helpers.data import EVAL_SUITE  # noqa: E402


def _announcing(generate, swallow: bool):
    def generate_announced(*args, **kwargs):
        print("regenerating", flush=True)
        while True:
            try:
                return generate(*args, **kwargs)
            except KeyboardInterrupt:
                if not swallow:
                    raise

    return generate_announced


if __name__ == "__main__":
    corpus.load_eval_suite = lambda: EVAL_SUITE
    swallow = os.environ.get("SWALLOW_INTERRUPTS") == "1"
    regenerate.generate_replies = _announcing(regenerate.generate_replies, swallow)
    regenerate.continuous_greedy_replies = _announcing(regenerate.continuous_greedy_replies, swallow)
    sys.exit(main(sys.argv[1:]))
