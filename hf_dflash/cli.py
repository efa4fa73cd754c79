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


def _run_demo(args: argparse.Namespace) -> int:
    import torch

    from .demo import SHIPPED_DRAFTER, run_demo

    rows = run_demo(
        max_new_tokens=args.max_new_tokens, dtype=getattr(torch, args.dtype), drafter_path=args.drafter or SHIPPED_DRAFTER
    )
    return 0 if all(row["identical"] for row in rows) else 1


def register_demo(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="generate with SmolLM2-135M-Instruct, plain greedy vs DFlash, side by side",
        description="Stream math, code and chat answers of SmolLM2-135M-Instruct through DFlash with the shipped "
        "drafter and print tokens/s plain vs DFlash, the mean acceptance length and whether outputs are identical.",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer (default: 128)")
    parser.add_argument(
        "--drafter", default=None, help="drafter folder (default: the shipped models/smollm2-135m-instruct-dflash)"
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="target dtype; float32 is token-exact, bfloat16 is faster but a k-token forward may round "
        "a near-tie differently from a 1-token forward (reported with its logit gap)",
    )
    parser.set_defaults(func=_run_demo)


def _run_cache_features(args: argparse.Namespace) -> int:
    import torch

    from .modeling_dflash import default_target_layer_ids
    from .models import load_target, resolve_dtype
    from .trainer.offline_features import cache_features

    target, _ = load_target(args.target, dtype=torch.float32)
    layer_ids = args.target_layer_ids or default_target_layer_ids(target.config.num_hidden_layers, 5)
    out = cache_features(
        target,
        args.data,
        args.out,
        layer_ids,
        dtype=resolve_dtype(args.dtype),
        batch_size=args.batch_size,
        shard_size_bytes=int(args.shard_size_mb * 2**20),
        target_name=args.target,
    )
    print(f"Wrote {args.target} features of layers {layer_ids} to {out}")
    return 0


def _layer_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, e.g. 1,8,14,20,27, got {text!r}") from None


def register_cache_features(subparsers) -> None:
    parser = subparsers.add_parser(
        "cache-features",
        help="precompute the target's features for offline drafter training (safetensors shards)",
        description="Run the target once over tokenised data (tokenized-*.jsonl) and store "
        "cat(h[i+1] for i in target_layer_ids) per sample in safetensors shards with an index.json. "
        "An interrupted run resumes where it stopped when re-run with the same arguments.",
    )
    parser.add_argument("--data", required=True, help="folder of tokenized-*.jsonl files")
    parser.add_argument("--out", required=True, help="feature cache folder (created, or resumed)")
    parser.add_argument("--target", default="smollm2-135m-instruct", help="a known target (default: %(default)s)")
    parser.add_argument(
        "--target-layer-ids",
        type=_layer_ids,
        default=None,
        help="0-based target layers, e.g. 1,8,14,20,27 (default: 5 layers spread as in the DFlash recipe)",
    )
    parser.add_argument(
        "--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"), help="storage dtype"
    )
    parser.add_argument("--batch-size", type=int, default=4, help="samples per target forward (default: 4)")
    parser.add_argument("--shard-size-mb", type=float, default=256, help="shard size in MiB (default: 256)")
    parser.set_defaults(func=_run_cache_features)


def _run_prepare_data(args: argparse.Namespace) -> int:
    from .data.pipeline import prepare_data
    from .data.sources import MissingDataPackageError
    from .models import MissingTargetPackageError

    sources = [name.strip() for name in args.sources.split(",") if name.strip()]
    try:
        summary = prepare_data(
            args.out,
            sources=sources,
            prompts_file=args.prompts,
            max_prompts=args.max_prompts,
            target=args.target,
            dtype=args.dtype,
            temperature=args.temperature,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            shard_size=args.shard_size,
            max_length=args.max_length,
            block_size=args.block_size,
            seed=args.seed,
        )
    except (MissingDataPackageError, MissingTargetPackageError) as error:
        raise ValueError(str(error)) from None
    for source, counts in summary["corpus"]["per_source"].items():
        print(f"{source:>10}: " + ", ".join(f"{key} {value}" for key, value in counts.items()))
    tokenized = summary["tokenized"]
    print(
        f"Wrote {tokenized.get('kept', 0)} samples ({tokenized.get('supervised_tokens', 0)} supervised tokens; "
        f"{tokenized.get('too_few_supervised', 0)} dropped with < {tokenized['min_supervised_tokens']}) "
        f"to {args.out}/tokenized"
    )
    return 0


def register_prepare_data(subparsers) -> None:
    from .data.sources import TRAIN_SOURCES

    parser = subparsers.add_parser(
        "prepare-data",
        help="build training data: prompt corpus -> replies regenerated by the target -> tokenised shards",
        description="Collect prompts from offline sources (and/or your JSONL), de-duplicate them and drop any "
        "sharing a 13-word run with the evaluation suite; regenerate every reply with the target (chat template, "
        "batched, resumable shards); tokenise with loss_mask on assistant tokens into OUT/tokenized. Re-running "
        "the same command resumes an interrupted run.",
    )
    parser.add_argument("--out", required=True, help="output folder (created, or resumed)")
    parser.add_argument(
        "--sources",
        default=",".join(TRAIN_SOURCES),
        help="comma-separated training sources, from: %(default)s (default: all; '' for only --prompts)",
    )
    parser.add_argument(
        "--prompts", default=None, help='your JSONL prompts: {"prompt": str} or {"messages": [...]} per line'
    )
    parser.add_argument("--max-prompts", type=int, default=None, help="keep at most N prompts (seeded random choice)")
    parser.add_argument("--target", default="smollm2-135m-instruct", help="a known target (default: %(default)s)")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="target dtype for generation (default: %(default)s)",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), > 0 samples")
    parser.add_argument("--max-new-tokens", type=int, default=512, help="reply length limit (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per generate call (default: %(default)s)")
    parser.add_argument("--shard-size", type=int, default=128, help="prompts per response shard (default: %(default)s)")
    parser.add_argument("--max-length", type=int, default=3072, help="sample length limit (default: %(default)s)")
    parser.add_argument(
        "--block-size", type=int, default=16, help="drafter block size: samples need 2x this many supervised tokens"
    )
    parser.add_argument("--seed", type=int, default=0, help="shuffle and sampling seed (default: %(default)s)")
    parser.set_defaults(func=_run_prepare_data)

def _run_train(args: argparse.Namespace) -> int:
    from .trainer.train import load_train_config, train_from_config

    trainer = train_from_config(load_train_config(args.config))
    if trainer.is_world_process_zero():
        print(f"Saved the trained drafter to {trainer.args.output_dir}")
    return 0


def register_train(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train (or resume, or LoRA-fine-tune) a DFlash drafter from a YAML config",
        description="Train a DFlash drafter with DFlashTrainer. The YAML config has the sections target, "
        "target_dtype, drafter, data, lora and training (DFlashTrainingArguments); see "
        "hf_dflash/trainer/train.py. Works under `accelerate launch` for several processes.",
    )
    parser.add_argument("--config", required=True, help="YAML training config")
    parser.set_defaults(func=_run_train)


def _run_export(args: argparse.Namespace) -> int:
    from .hub_cards import export_drafter

    out = export_drafter(
        args.drafter,
        args.out_dir,
        target_id=args.target_id,
        benchmark_json=args.benchmark,
        training_record=args.training_record,
        official=args.official,
        license=args.license,
        dtype=args.dtype,
        repo_id=args.repo_id,
    )
    print(f"Wrote the Hub repository folder to {out}; publish it with: hf-dflash push {out} --repo-id ORG/NAME")
    return 0


def register_export(subparsers) -> None:
    parser = subparsers.add_parser(
        "export",
        help="write a drafter as a complete Hub repository folder (weights, remote code, model card)",
        description="Write DRAFTER (either checkpoint format, folder or Hub id) into OUT_DIR as a Hub repository: "
        "config.json with auto_map, the remote-code files, model.safetensors and a README.md model card filled "
        "from the drafter config, the training record and the benchmark JSON (without them the card says so).",
    )
    parser.add_argument("drafter", help="drafter checkpoint folder (or Hub repo id)")
    parser.add_argument("out_dir", help="new or empty output folder")
    parser.add_argument(
        "--target-id", required=True, help="the target's Hub id, e.g. HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    parser.add_argument(
        "--repo-id", default=None, help="the drafter's own Hub id for the card's snippets (default: set by push)"
    )
    parser.add_argument("--benchmark", default=None, help="benchmark JSON: {command, machine, settings, sets}")
    parser.add_argument(
        "--training-record", default=None, help="training_record.json written by training (in its output_dir)"
    )
    parser.add_argument("--official", action="store_true", help="also write official/ for vLLM / SGLang")
    parser.add_argument("--dtype", default=None, help="cast the weights, e.g. bfloat16 (default: keep)")
    parser.add_argument("--license", default="apache-2.0", help="card license (default: %(default)s)")
    parser.set_defaults(func=_run_export)


def _run_push(args: argparse.Namespace) -> int:
    from .hub_cards import push_folder

    url = push_folder(args.out_dir, args.repo_id, private=not args.public)
    print(f"Pushed {args.out_dir} to {url} ({'public' if args.public else 'private'})")
    return 0


def register_push(subparsers) -> None:
    parser = subparsers.add_parser(
        "push",
        help="upload a folder written by `hf-dflash export` to the Hugging Face Hub",
        description="Create the model repository (private unless --public; an existing one keeps its visibility) "
        "and upload OUT_DIR. Needs a token with write access: `hf auth login` or HF_TOKEN.",
    )
    parser.add_argument("out_dir", help="folder written by `hf-dflash export`")
    parser.add_argument("--repo-id", required=True, help="target repository, e.g. me/SmolLM2-135M-Instruct-DFlash")
    parser.add_argument("--public", action="store_true", help="create the repository public (default: private)")
    parser.set_defaults(func=_run_push)


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _run_bench(args: argparse.Namespace) -> int:
    from .bench import EVAL_SETS, run_bench
    from .data.sources import MissingDataPackageError
    from .models import MissingTargetPackageError

    # --prompts alone benchmarks only that file; --sets (or neither) picks evaluation sets
    sets = args.sets if args.sets is not None else ([] if args.prompts else list(EVAL_SETS))
    try:
        run_bench(
            target=args.target,
            drafter=args.drafter,
            sets=sets,
            prompts=args.prompts,
            num_prompts=args.num_prompts,
            max_new_tokens=args.max_new_tokens,
            dtype=args.dtype,
            temperature=args.temperature,
            seed=args.seed,
            out=args.out,
            methods=args.methods,
            device=args.device,
            block_size_policy=args.block_size_policy,
            progress=not args.no_progress,
        )
    except (MissingDataPackageError, MissingTargetPackageError) as error:
        raise ValueError(str(error)) from None
    return 0


def register_bench(subparsers) -> None:
    from .bench import EVAL_SETS, METHODS
    from .bench.prompts import BENCH_SETS

    parser = subparsers.add_parser(
        "bench",
        help="benchmark plain decoding, DFlash (ours and Transformers' built-in), prompt lookup and hybrid "
        "drafting side by side",
        description="Run every method on the same prompts (a seeded sample of each evaluation set, or your JSONL), "
        "interleaved per prompt with the method order rotated, and report per set and overall: mean acceptance "
        "length τ, the acceptance-length histogram, tokens/s, speed-up over plain decoding and whether every "
        "greedy output equals plain greedy (a difference is reported with the target's top-2 logit gap there). "
        "Writes OUT/bench.json, OUT/benchmark.json (the model-card benchmark for `hf-dflash export`) and PNG plots.",
    )
    parser.add_argument(
        "--target",
        default="smollm2-135m-instruct",
        help="a known target or a local model folder (default: %(default)s)",
    )
    parser.add_argument(
        "--drafter", required=True, help="drafter checkpoint folder (either format), or 'random' for an untrained one"
    )
    parser.add_argument(
        "--sets",
        type=_names,
        default=None,
        help=f"comma-separated sets from {','.join(BENCH_SETS)} (code-edit: copy-heavy HumanEval edits; "
        f"default: the evaluation sets {','.join(EVAL_SETS)}, or none with --prompts)",
    )
    parser.add_argument(
        "--prompts", default=None, help='your JSONL prompts: {"prompt": str} or {"messages": [...]} per line'
    )
    parser.add_argument(
        "--num-prompts", type=int, default=8, help="prompts sampled per set with the seed, 0 = all (default: 8)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=256, help="per answer (turn) (default: %(default)s)")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float16", "float32"),
        help="target and drafter dtype (default: %(default)s; float32 is token-exact, bfloat16 may flip near-ties)",
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples (seeded, no identity check)"
    )
    parser.add_argument("--seed", type=int, default=0, help="prompt sampling, sampling and random drafter seed")
    parser.add_argument("--out", default="out/bench", help="output folder (default: %(default)s)")
    parser.add_argument(
        "--methods",
        type=_names,
        default=list(METHODS),
        help=f"comma-separated, from {','.join(METHODS)} (default: all)",
    )
    parser.add_argument("--device", default=None, help="e.g. cpu, cuda:0 (default: cuda when available, else cpu)")
    parser.add_argument(
        "--block-size-policy", default="trained",
        help="our DFlash method's block length per round: 'trained' (default), 'adaptive', or a fixed k",
    )  # fmt: skip
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=_run_bench)


def _run_generate(args: argparse.Namespace) -> int:
    from .generation.batch_cli import run_generate

    run_generate(args)
    return 0


def register_generate(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="answer a JSONL of prompts in batches with DFlash (batched speculative decoding)",
        description="Greedy answers for every line of a JSONL prompt file ({\"prompt\": ...} or {\"messages\": [...]}), "
        "left-padded in batches; prints throughput (new tokens summed over rows per second) and τ.",
    )
    parser.add_argument("--prompts", required=True, help="JSONL prompt file")
    parser.add_argument("--out", required=True, help="output JSONL (id, messages, response, new_tokens)")
    parser.add_argument("--target", default="smollm2-135m-instruct", help="known target name or local folder")
    parser.add_argument("--drafter", default="random", help="drafter folder (either format), 'random' or 'none'")
    parser.add_argument("--batch-size", type=int, default=8, help="rows per batch (default: 8)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer (default: 256)")
    parser.add_argument("--dtype", default="bfloat16", help="target and drafter dtype (default: bfloat16)")
    parser.add_argument(
        "--block-size-policy", default="trained",
        help="block length per round: 'trained' (the drafter's block size, default), 'adaptive', or a fixed k",
    )  # fmt: skip
    parser.set_defaults(func=_run_generate)


COMMANDS: list[Callable] = [
    register_convert,
    register_demo,
    register_cache_features,
    register_prepare_data,
    register_train,
    register_export,
    register_push,
    register_bench,
    register_generate,
]


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
