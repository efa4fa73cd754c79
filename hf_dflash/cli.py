"""`hf-dflash` command line.

Each subcommand is one `register_<name>(subparsers)` function that adds its parser and sets
`func=<run function>`; add a new command by writing both and appending the register function to
`COMMANDS`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence


def _run_convert(args: argparse.Namespace) -> int:
    from .checkpoints import convert

    out = convert(args.src, args.dst, to=args.to, dtype=args.dtype)
    print(f"Wrote {args.to} DFlash checkpoint to {out}")
    return 0


def register_convert(subparsers) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="convert a drafter checkpoint between the Hub-native and official (vLLM/SGLang) formats",
        description="Convert a DFlash drafter checkpoint (either format, local folder or Hub repo id) to "
        "the Hub-native format (model_type 'dflash', remote code) or the official format "
        "(model_type 'qwen3' + dflash_config, served by vLLM/SGLang).",
    )
    parser.add_argument("src", help="source checkpoint folder (or Hub repo id)")
    parser.add_argument("dst", help="destination folder")
    parser.add_argument("--to", required=True, choices=("official", "hub"), help="output format")
    parser.add_argument("--dtype", default=None, help="cast weights, e.g. bfloat16 (default: keep)")
    parser.set_defaults(func=_run_convert)


COMMANDS: list[Callable] = [register_convert]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-dflash", description="DFlash speculative decoding tools.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in COMMANDS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `hf-dflash` console script; returns the exit status.
    User errors (ValueError) print `hf-dflash: error: ...` on stderr and return 1."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as error:
        print(f"hf-dflash {args.command}: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
