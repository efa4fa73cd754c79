"""Worker for the recipe's `accelerate launch` test: `hf-dflash recipe ARGS...` with the tiny eval suite.

Run under `accelerate launch --multi_gpu --num_processes 2` (gloo on CPU) or as a plain single process.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_dflash.cli import main  # noqa: E402
from hf_dflash.data import corpus  # noqa: E402
from tests.helpers.data import EVAL_SUITE  # noqa: E402

if __name__ == "__main__":
    corpus.load_eval_suite = lambda: EVAL_SUITE
    sys.exit(main(sys.argv[1:]))
