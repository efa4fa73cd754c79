"""`hf-dflash` command line.

Each subcommand is one `register_<name>(subparsers)` function that adds its parser and sets
`func=<run function>`; add a new command by writing both and appending the register function to
`COMMANDS`.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Sequence

from .generation.verifying.compiling import COMPILE_SETTINGS
from .targets import DEFAULT_TARGET
from .user_errors import run_reporting_errors

DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")


def _add_dtype_argument(parser, what: str) -> None:
    """--dtype, default "auto": bfloat16 where the hardware multiplies bf16 natively, else float32 (see dtypes.py)."""
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help=f"{what} (default: auto = bfloat16 on CUDA and on CPUs with native bf16 such as AVX-512 BF16/AMX, "
        "else float32; the choice and its reason are printed). float32 is token-exact; in bf16 a k-token "
        "forward may round a near-tie differently from a 1-token forward",
    )


def _command(subparsers, name: str, run: Callable[[argparse.Namespace], int]) -> argparse.ArgumentParser:
    """The subcommand `name`, running `run`: its help is the first paragraph of `run`'s docstring, its
    description the rest."""
    summary, _, details = (run.__doc__ or "").partition("\n\n")  # empty under python -OO
    parser = subparsers.add_parser(name, help=" ".join(summary.split()), description=" ".join(details.split()))
    parser.set_defaults(func=run)
    return parser


def _same_named(args: argparse.Namespace, names: str) -> dict:
    """{name: args.<name>} for each of the space-separated `names`: options passed on under their own name."""
    return {name: getattr(args, name) for name in names.split()}


@contextlib.contextmanager
def _missing_packages_as_errors():
    """A missing data or target package becomes a ValueError, which `main` prints with its install command."""
    from .data.sources import MissingDataPackageError
    from .targets import MissingTargetPackageError

    try:
        yield
    except (MissingDataPackageError, MissingTargetPackageError) as error:
        raise ValueError(str(error)) from None


def _announce_dtype(dtype: str, device: str = "cpu") -> None:
    from .dtypes import describe_dtype

    print(f"dtype: {describe_dtype(dtype, device)}")


def _non_negative_float(text: str) -> float:
    """argparse type: a float >= 0 (a temperature)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 = greedy), got {text}")
    return value


def _device(text: str) -> str:
    """argparse type: a torch device this machine has (`models.resolve_device`)."""
    from .targets import resolve_device

    try:
        resolve_device(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


TARGET_HEAD_HELP = (
    "a known target, a local model folder or a Hub id: an official or speculators copy of a drafter with a pruned "
    "draft vocabulary holds that target's LM-head rows (loaded only for such a drafter); a speculators copy also "
    "names it as its verifier (required for --to speculators)"
)


EXPAND_VOCABULARY_HELP = (
    "write a drafter with a pruned draft vocabulary as one over the target's whole vocabulary (no d2t/t2d; it scores "
    "with the target's whole head, a DFlash2 selector ranks over every id): its drafts CHANGE, since an id outside "
    "the draft vocabulary can win a slot (docs/serving.md gives the measured acceptance). The only vLLM / "
    "speculators layout of a pruned DFlash2 drafter"
)


def _run_convert(args: argparse.Namespace) -> int:
    """convert a drafter checkpoint between the Hub-native, official (vLLM/SGLang) and speculators formats

    Convert a DFlash drafter checkpoint (Hub-native, official or vLLM speculators; local folder or Hub repo id)
    to the Hub-native format (model_type 'dflash', remote code), the official format (model_type 'qwen3' +
    dflash_config, served by vLLM/SGLang) or vLLM speculators' layout (speculators_model_type dflash/dflash2,
    naming --target as its verifier). DST must be new or empty unless --overwrite.
    """
    from .checkpoints import convert

    out = convert(
        args.src, args.dst, to=args.to, dtype=args.dtype, overwrite=args.overwrite,
        num_target_layers=args.num_target_layers, target=args.target, expand_vocabulary=args.expand_vocabulary,
    )  # fmt: skip
    print(f"Wrote {args.to} DFlash checkpoint to {out}" + (" (replaced the whole folder)" if args.overwrite else ""))
    return 0


def register_convert(subparsers) -> None:
    parser = _command(subparsers, "convert", _run_convert)
    parser.add_argument("src", help="source checkpoint folder (or Hub repo id)")
    parser.add_argument("dst", help="destination folder (new or empty)")
    parser.add_argument("--to", required=True, choices=("official", "hub", "speculators"), help="output format")
    parser.add_argument("--dtype", default=None, help="cast weights, e.g. bfloat16 (default: keep)")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a non-empty DST entirely (no stale files are kept)"
    )
    parser.add_argument(
        "--num-target-layers", type=int, default=None,
        help="the target's decoder layers, for a vLLM speculators source (it does not record them)",
    )  # fmt: skip
    parser.add_argument("--target", default=None, help=TARGET_HEAD_HELP)
    parser.add_argument("--expand-vocabulary", action="store_true", help=EXPAND_VOCABULARY_HELP)


def _run_demo(args: argparse.Namespace) -> int:
    """generate with SmolLM2-135M-Instruct, plain greedy vs DFlash, side by side

    Stream math, code and chat answers of SmolLM2-135M-Instruct through DFlash with the shipped drafter and
    print tokens/s plain vs DFlash, the mean acceptance length and whether outputs are identical.
    """
    from .demo import SHIPPED_DRAFTER, demo_succeeded, run_demo

    _announce_dtype(args.dtype)
    rows = run_demo(max_new_tokens=args.max_new_tokens, dtype=args.dtype, drafter_path=args.drafter or SHIPPED_DRAFTER)
    return 0 if demo_succeeded(rows) else 1


def register_demo(subparsers) -> None:
    parser = _command(subparsers, "demo", _run_demo)
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer (default: 128)")
    parser.add_argument(
        "--drafter", default=None, help="drafter folder (default: the shipped models/smollm2-135m-instruct-dflash)"
    )
    _add_dtype_argument(parser, "target and drafter dtype")


def _run_cache_features(args: argparse.Namespace) -> int:
    """precompute the target's features for offline drafter training (safetensors shards)

    Run the target once over tokenised data (tokenized-*.jsonl) and store cat(h[i+1] for i in target_layer_ids)
    per sample in safetensors shards with an index.json. An interrupted run resumes where it stopped when re-run
    with the same arguments.
    """
    from .data.feature_cache import cache_features
    from .folder_lock import folder_lock
    from .modeling_dflash import default_target_layer_ids
    from .output_paths import check_output_folder
    from .targets import load_target, resolve_dtype

    check_output_folder(args.out)
    with folder_lock(args.out, "cache-features"):  # a second writer is refused before the target loads
        _announce_dtype(args.target_dtype)
        target, _ = load_target(args.target, dtype=args.target_dtype)
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
            teacher_top_k=args.teacher_top_k,
            lock=False,
        )
    teacher = f" and its top-{args.teacher_top_k} next tokens" if args.teacher_top_k else ""
    print(f"Wrote {args.target} features of layers {layer_ids}{teacher} to {out}")
    return 0


def _layer_ids(text: str) -> list[int]:
    """argparse type: distinct 0-based layer ids, comma-separated."""
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, e.g. 1,8,14,20,27, got {text!r}"
        ) from None
    if len(set(ids)) != len(ids) or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"expected distinct 0-based layer ids, e.g. 1,8,14,20,27, got {text!r}")
    return ids


def register_cache_features(subparsers) -> None:
    parser = _command(subparsers, "cache-features", _run_cache_features)
    parser.add_argument("--data", required=True, help="folder of tokenized-*.jsonl files")
    parser.add_argument("--out", required=True, help="feature cache folder (created, or resumed)")
    parser.add_argument("--target", default=DEFAULT_TARGET, help="a known target (default: %(default)s)")
    parser.add_argument(
        "--target-layer-ids",
        type=_layer_ids,
        default=None,
        help="0-based target layers, e.g. 1,8,14,20,27 (default: 5 layers spread as in the DFlash recipe)",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"), help="storage dtype")
    parser.add_argument(
        "--target-dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="dtype the target computes the features in (default: auto, the dtype generation will use on this "
        "machine: train on what you serve)",
    )
    parser.add_argument("--batch-size", type=int, default=4, help="samples per target forward (default: 4)")
    parser.add_argument("--shard-size-mb", type=float, default=256, help="shard size in MiB (default: 256)")
    parser.add_argument(
        "--teacher-top-k",
        type=int,
        default=0,
        help="also store the target's K most likely next tokens and log-probabilities at every position, the "
        "teacher of offline distillation (training.loss_type kl / ce+kl); 0: features only (default)",
    )


def _run_prepare_data(args: argparse.Namespace) -> int:
    """build training data: prompt corpus -> replies regenerated by the target -> tokenised shards

    Collect prompts from offline sources (and/or your JSONL), de-duplicate them and drop any sharing a 13-word
    run with the evaluation suite; regenerate every reply with the target (chat template, batched, resumable
    shards); tokenise with loss_mask on assistant tokens into OUT/tokenized. Re-running the same command resumes
    an interrupted run.
    """
    from .data.pipeline import prepare_data

    sources = [name.strip() for name in args.sources.split(",") if name.strip()]
    _announce_dtype(args.dtype)
    with _missing_packages_as_errors():
        summary = prepare_data(
            args.out,
            sources=sources,
            prompts_file=args.prompts,
            **_same_named(
                args,
                "max_prompts target dtype temperature max_new_tokens batch_size shard_size max_length "
                "max_prompt_tokens block_size seed",
            ),
        )
    for source, counts in summary["corpus"]["per_source"].items():
        print(f"{source:>10}: " + ", ".join(f"{key} {value}" for key, value in counts.items()))
    tokenized = summary["tokenized"]
    print(
        f"Wrote {tokenized.get('kept', 0)} samples ({tokenized.get('supervised_tokens', 0)} supervised tokens; "
        f"{tokenized.get('too_few_supervised', 0)} dropped with < {tokenized['min_supervised_tokens']}) "
        f"to {args.out}/tokenized"
    )
    if not tokenized.get("kept"):
        conversations = tokenized.get("conversations", 0)
        why = (
            f"all {conversations} replies had fewer than {tokenized['min_supervised_tokens']} supervised tokens "
            f"(2 x --block-size {args.block_size}): raise --max-new-tokens or lower --block-size"
            if conversations
            else "no prompt reached the regeneration stage: check --sources/--prompts and the corpus summary"
        )
        raise ValueError(f"prepare-data ended with 0 training samples in {args.out}/tokenized; {why}.")
    return 0


def register_prepare_data(subparsers) -> None:
    from .data.regenerate import DEFAULT_REGENERATION_BATCH, DEFAULT_REGENERATION_SHARD
    from .data.sources import DEFAULT_TRAIN_SOURCES, TRAIN_SOURCES
    from .modeling_dflash import DFlashConfig

    parser = _command(subparsers, "prepare-data", _run_prepare_data)
    parser.add_argument("--out", required=True, help="output folder (created, or resumed)")
    parser.add_argument(
        "--sources",
        default=",".join(DEFAULT_TRAIN_SOURCES),
        help=f"comma-separated training sources, from: {','.join(TRAIN_SOURCES)} (default: %(default)s; '' for only "
        "--prompts)",
    )
    parser.add_argument(
        "--prompts", default=None, help='your JSONL prompts: {"prompt": str} or {"messages": [...]} per line'
    )
    parser.add_argument("--max-prompts", type=int, default=None, help="keep at most N prompts (seeded random choice)")
    parser.add_argument("--target", default=DEFAULT_TARGET, help="a known target (default: %(default)s)")
    _add_dtype_argument(parser, "target dtype for regeneration")
    parser.add_argument(
        "--temperature", type=_non_negative_float, default=0.0, help="0 = greedy (default), > 0 samples"
    )
    parser.add_argument("--max-new-tokens", type=int, default=512, help="reply length limit (default: %(default)s)")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=DEFAULT_REGENERATION_BATCH,
        help="rows decoded at once (continuous batching for greedy; default: %(default)s, the fastest measured on a 2-core CPU)",
    )
    parser.add_argument(
        "--shard-size",
        type=int,
        default=DEFAULT_REGENERATION_SHARD,
        help="prompts per response shard (default: %(default)s)",
    )
    parser.add_argument("--max-length", type=int, default=3072, help="sample length limit (default: %(default)s)")
    parser.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="skip longer rendered prompts (default: every prompt that leaves --max-new-tokens of room within "
        "--max-length; long prompts cost more to regenerate (docs/data.md) and teach the drafter long contexts)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=DFlashConfig.block_size,
        help="drafter block size: samples need 2x this many supervised tokens",
    )
    parser.add_argument("--seed", type=int, default=0, help="shuffle and sampling seed (default: %(default)s)")


def _run_train(args: argparse.Namespace) -> int:
    """train (or resume, or LoRA-fine-tune) a DFlash drafter from a YAML config

    Train a DFlash drafter with DFlashTrainer. The YAML config has the sections target, target_dtype, drafter,
    data, lora and training (DFlashTrainingArguments); see hf_dflash/trainer/train.py. Works under `accelerate
    launch` for several processes.
    """
    from .trainer.train import load_train_config, train_from_config

    trainer = train_from_config(load_train_config(args.config))
    if trainer is not None and trainer.is_world_process_zero():
        print(f"Saved the trained drafter to {trainer.args.output_dir}")
    return 0


def register_train(subparsers) -> None:
    parser = _command(subparsers, "train", _run_train)
    parser.add_argument("--config", required=True, help="YAML training config")


def _run_export(args: argparse.Namespace) -> int:
    """write a drafter as a complete Hub repository folder (weights, remote code, model card)

    Write DRAFTER (either checkpoint format, folder or Hub id) into OUT_DIR as a Hub repository: config.json
    with auto_map, the remote-code files, model.safetensors and a README.md model card filled from the drafter
    config, the training record and the benchmark JSON (without them the card says so).
    """
    from .checkpoints import export_drafter

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
        target=args.target,
        expand_vocabulary=args.expand_vocabulary,
    )
    print(f"Wrote the Hub repository folder to {out}; publish it with: hf-dflash push {out} --repo-id ORG/NAME")
    return 0


def register_export(subparsers) -> None:
    parser = _command(subparsers, "export", _run_export)
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
    parser.add_argument("--target", default=None, help=TARGET_HEAD_HELP)
    parser.add_argument(
        "--expand-vocabulary", action="store_true", help=EXPAND_VOCABULARY_HELP + " (official/ only; with --official)"
    )
    parser.add_argument("--license", default="apache-2.0", help="card license (default: %(default)s)")


def _run_push(args: argparse.Namespace) -> int:
    """upload a folder written by `hf-dflash export` to the Hugging Face Hub

    Create the model repository (private unless --public; an existing one keeps its visibility) and upload
    OUT_DIR. Needs a token with write access: `hf auth login` or HF_TOKEN.
    """
    from .checkpoints import push_folder

    url = push_folder(args.out_dir, args.repo_id, private=not args.public)
    print(f"Pushed {args.out_dir} to {url} ({'public' if args.public else 'private'})")
    return 0


def register_push(subparsers) -> None:
    parser = _command(subparsers, "push", _run_push)
    parser.add_argument("out_dir", help="folder written by `hf-dflash export`")
    parser.add_argument("--repo-id", required=True, help="target repository, e.g. me/SmolLM2-135M-Instruct-DFlash")
    parser.add_argument("--public", action="store_true", help="create the repository public (default: private)")


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _run_bench(args: argparse.Namespace) -> int:
    """benchmark plain decoding, DFlash (ours and Transformers' built-in), prompt lookup and hybrid drafting side
    by side

    Run every method on the same prompts (a seeded sample of each evaluation set, or your JSONL), interleaved
    per prompt with the method order rotated, and report per set and overall: mean acceptance length τ, the
    acceptance-length histogram, tokens/s, speed-up over plain decoding and whether every greedy output equals
    plain greedy (a difference is reported with the target's top-2 logit gap there). Writes OUT/bench.json,
    OUT/benchmark.json (the model-card benchmark for `hf-dflash export`) and PNG plots.
    """
    from .bench import EVAL_SETS, run_bench

    # --prompts alone benchmarks only that file; --sets (or neither) picks evaluation sets
    sets = args.sets if args.sets is not None else ([] if args.prompts else list(EVAL_SETS))
    with _missing_packages_as_errors():
        run_bench(
            sets=sets,
            progress=not args.no_progress,
            **_same_named(
                args,
                "target drafter prompts num_prompts max_new_tokens dtype temperature seed out methods device "
                "block_size_policy draft_temperature",
            ),
        )
    return 0


def register_bench(subparsers) -> None:
    from .bench import EVAL_SETS, METHODS
    from .bench.prompts import BENCH_SETS

    parser = _command(subparsers, "bench", _run_bench)
    parser.add_argument(
        "--target",
        default=DEFAULT_TARGET,
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
        "long-docs, long-code: documents and code files of 3k-12k characters with a task; "
        f"default: the evaluation sets {','.join(EVAL_SETS)}, or none with --prompts)",
    )
    parser.add_argument(
        "--prompts", default=None, help='your JSONL prompts: {"prompt": str} or {"messages": [...]} per line'
    )
    parser.add_argument(
        "--num-prompts", type=int, default=None,
        help="prompts sampled per set with the seed, 0 = all (default: 8 per built-in set, every prompt of --prompts)",
    )  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=256, help="per answer (turn) (default: %(default)s)")
    _add_dtype_argument(parser, "target and drafter dtype")
    parser.add_argument(
        "--temperature",
        type=_non_negative_float,
        default=0.0,
        help="0 = greedy (default); > 0 samples (seeded, no identity check)",
    )
    parser.add_argument("--seed", type=int, default=0, help="prompt sampling, sampling and random drafter seed")
    parser.add_argument("--out", default="out/bench", help="output folder (default: %(default)s)")
    parser.add_argument(
        "--methods",
        type=_names,
        default=list(METHODS),
        help=f"comma-separated, from {','.join(METHODS)} (default: all)",
    )
    parser.add_argument(
        "--device", type=_device, default=None, help="e.g. cpu, cuda:0 (default: cuda when available, else cpu)"
    )
    parser.add_argument(
        "--block-size-policy", default="recommended",
        help="our DFlash method's block length per round: 'recommended' (default: the drafter config's "
        "block_size_policy, else its block size), 'trained' (its block size), 'adaptive', 'confidence' (the "
        "whole block drafted, its likely prefix verified), or a fixed k",
    )  # fmt: skip
    parser.add_argument(
        "--draft-temperature", type=_non_negative_float, default=None,
        help="with --temperature > 0: the temperature our DFlash drafter drafts at (0: its argmax; default: the call's)",
    )  # fmt: skip
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _run_generate(args: argparse.Namespace) -> int:
    """answer a JSONL of prompts in batches with DFlash (batched speculative decoding)

    Greedy answers for every line of a JSONL prompt file ({"prompt": ...} or {"messages": [...]}), left-padded
    in batches; prints throughput (new tokens summed over rows per second) and τ.
    """
    from .generate_command import run_generate

    run_generate(args)
    return 0


def register_generate(subparsers) -> None:
    parser = _command(subparsers, "generate", _run_generate)
    parser.add_argument("--prompts", required=True, help="JSONL prompt file")
    parser.add_argument(
        "--out", required=True, help="output JSONL (id, messages, response, new_tokens); new unless --overwrite"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing --out file (never the --prompts file)"
    )
    parser.add_argument("--target", default=DEFAULT_TARGET, help="known target name or local folder")
    parser.add_argument(
        "--drafter",
        default=None,
        help="drafter folder (either format), 'random' (untrained) or 'none' (plain decoding); default: the shipped "
        f"drafter of {DEFAULT_TARGET}, required for other targets",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="rows per batch (default: 8)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="tokens per answer (default: 256)")
    _add_dtype_argument(parser, "target and drafter dtype")
    parser.add_argument(
        "--compile", default="auto", choices=COMPILE_SETTINGS,
        help="static cache + torch.compile: 'auto' (default) compiles on accelerators, not on CPU; 'on' forces it; "
        "the run prints what was chosen and why",
    )  # fmt: skip
    parser.add_argument(
        "--block-size-policy", default="recommended",
        help="block length per round: 'recommended' (default: the drafter config's block_size_policy, else "
        "its block size), 'trained' (its block size), 'adaptive', 'confidence' (the whole block drafted, its "
        "likely prefix verified), or a fixed k",
    )  # fmt: skip


def _run_pack_data(args: argparse.Namespace) -> int:
    """pack tokenised shards into compact, versioned safetensors shards with a manifest (committable)

    Append the tokenized-*.jsonl shards of TOKENIZED not packed yet to OUT as part PART: uint16 token ids + loss
    masks per shard, a manifest with the settings of each part, counts per source and sha256 per shard. Training
    reads OUT directly (data.tokenized: OUT).
    """
    from transformers import AutoTokenizer

    from .data.packed import check_part_name, pack_tokenized, recorded_settings
    from .folder_lock import folder_lock
    from .output_paths import check_output_folder
    from .targets import default_cache_dir, get_spec, load_target

    check_part_name(args.part)  # every argument is checked before the target's tokenizer is loaded
    check_output_folder(args.out)
    if args.samples_per_shard < 1:
        raise ValueError(f"--samples-per-shard must be >= 1, got {args.samples_per_shard}.")
    settings = recorded_settings(args.tokenized, args.responses, args.corpus, args.note)
    get_spec(args.target)
    with folder_lock(args.out, "pack-data"):  # a second writer is refused before the tokenizer loads
        folder = default_cache_dir() / args.target
        if not folder.is_dir():
            load_target(args.target)  # converts the target once, which also writes its tokenizer
        tokenizer = AutoTokenizer.from_pretrained(folder)
        manifest = pack_tokenized(
            args.tokenized,
            args.out,
            part=args.part,
            settings=settings,
            tokenizer=tokenizer,
            samples_per_shard=args.samples_per_shard,
            lock=False,
        )
    totals = manifest["totals"]
    print(
        f"{args.out}: {len(manifest['shards'])} shards, {totals.get('samples', 0)} samples, "
        f"{totals.get('supervised_tokens', 0)} supervised tokens; per source {totals.get('per_source', {})}"
    )
    return 0


def register_pack_data(subparsers) -> None:
    parser = _command(subparsers, "pack-data", _run_pack_data)
    parser.add_argument("--tokenized", required=True, help="folder of tokenized-*.jsonl (prepare-data's tokenized/)")
    parser.add_argument("--out", required=True, help="packed folder (created, or appended to)")
    parser.add_argument("--part", required=True, help="name of this regeneration run, e.g. regen-bf16-1")
    parser.add_argument("--responses", default=None, help="the run's responses/ folder (its settings are recorded)")
    parser.add_argument("--corpus", default=None, help="the run's corpus/ folder (its settings are recorded)")
    parser.add_argument("--note", default=None, help="free text recorded with the part (machine, command)")
    parser.add_argument("--target", default=DEFAULT_TARGET, help="the known target whose tokenizer made the ids")
    parser.add_argument("--samples-per-shard", type=int, default=2048, help="samples per packed shard (default: 2048)")


def _run_recipe(args: argparse.Namespace) -> int:
    """run every stage from a causal-LM target to an exported drafter (resumable)

    Prompts (decontaminated corpus), replies regenerated by the target, tokenisation and packing, optional
    feature caching, training, held-out tau, bench and export with card, each skipped when its output is
    complete (OUT/stages/STAGE.json) and resumed when interrupted. Settings the config leaves out (target layers,
    block size, draft vocabulary, drafter depth) are derived from the target and printed with their reasons.
    Works under `accelerate launch`. See docs/recipe.md.
    """
    from .recipe import run_recipe

    with _missing_packages_as_errors():
        return run_recipe(
            args.out, args.target, args.config, max_prompts=args.max_prompts, target_id=args.target_id, redo=args.redo
        )


def register_recipe(subparsers) -> None:
    parser = _command(subparsers, "recipe", _run_recipe)
    parser.add_argument("--target", default=None, help="a known target or a local Transformers causal-LM folder")
    parser.add_argument("--out", required=True, help="recipe folder (new, empty, or an earlier recipe run's)")
    parser.add_argument("--config", default=None, help="recipe YAML (every key optional; docs/recipe.md)")
    parser.add_argument("--max-prompts", type=int, default=None, help="keep at most N prompts (a short run)")
    parser.add_argument("--target-id", default=None, help="the target's Hub id for the card (local folders)")
    parser.add_argument("--redo", default=None, help="delete STAGE's output and re-run it and every later stage")


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
    register_pack_data,
    register_recipe,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-dflash", description="DFlash speculative decoding tools.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in COMMANDS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `hf-dflash` console script; returns the exit status.
    User errors (bad values, files and folders: `user_errors`) print `hf-dflash <cmd>: error: ...` on stderr
    and return 2, like argparse's own errors. Run as the program (`argv` None), a refusal before any work (another
    process writes to the output folder) ends the process at once with status 2. Ctrl-C returns 130
    (`hf_dflash.interrupts`)."""
    from .interrupts import INTERRUPTED, interrupted, recording_interrupts

    parser = build_parser()
    args = parser.parse_args(argv)
    prog = f"hf-dflash {args.command}"
    with recording_interrupts():  # Ctrl-C stops, even where a library swallowed its KeyboardInterrupt
        try:
            status = run_reporting_errors(prog, lambda: args.func(args), exit_at_once=argv is None)
        except KeyboardInterrupt:
            status = INTERRUPTED
        if interrupted() or status == INTERRUPTED:
            print(
                f"{prog}: interrupted (Ctrl-C); finished work is kept: run the same command to resume.", file=sys.stderr
            )
            return INTERRUPTED
    return status


if __name__ == "__main__":
    sys.exit(main())
