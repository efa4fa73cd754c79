"""Publishing: a drafter as a complete Hub repository folder, and pushing that folder to the Hub.

    export_drafter("out/drafter", "out/repo", target_id="HuggingFaceTB/SmolLM2-135M-Instruct",
                   benchmark_json="out/bench.json", training_record="out/drafter/training_record.json",
                   official=True, dtype="bfloat16", repo_id="me/SmolLM2-135M-Instruct-DFlash")
    push_folder("out/repo", "me/SmolLM2-135M-Instruct-DFlash")   # private unless private=False

The folder (a Hub-native checkpoint):

    config.json                 model_type "dflash", auto_map -> the two remote-code files
    configuration_dflash.py     remote code (imports only torch / transformers)
    modeling_dflash.py
    custom_generate/generate.py the DFlash loop for plain Transformers' generate(custom_generate=<repo>)
    model.safetensors
    README.md                   model card (hf_dflash/hub_cards/template.md)
    benchmark.json              when a benchmark was given (validated copy)
    training_record.json        when a training record was given (validated copy)
    official/                   when official=True: config.json (model_type "qwen3" + dflash_config)
                                and model.safetensors, for vLLM / SGLang / SpecForge
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path

import huggingface_hub
import torch
from huggingface_hub import CommitOperationAdd
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

from ..folder_lock import LOCK_NAME, folder_lock
from ..hub_cards.card import REPO_ID_PLACEHOLDER, render_model_card
from ..hub_cards.schemas import BENCHMARK_NAME, TRAINING_RECORD_NAME, load_benchmark, load_training_record
from .converting import official_head_source
from .files import CONFIG_NAME, as_dtype
from .hub import save_hub
from .loading import load_drafter
from .official import official_head, save_official
from .vocabulary import expand_draft_vocabulary

OFFICIAL_SUBFOLDER = "official"
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
LOGIN_HINT = (
    "log in with `hf auth login` (a token with write access from https://huggingface.co/settings/tokens), "
    "or set HF_TOKEN=hf_..., or pass token=..."
)


def check_hub_id(value: str, name: str) -> None:
    if not isinstance(value, str) or not _HUB_ID.match(value) or "--" in value or ".." in value:
        raise ValueError(
            f"{name}={value!r} is not a Hub repository id; use 'org/name', e.g. 'HuggingFaceTB/SmolLM2-135M-Instruct'."
        )


def export_drafter(
    drafter_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    target_id: str,
    benchmark_json: str | os.PathLike | dict | None = None,
    training_record: str | os.PathLike | dict | None = None,
    official: bool = False,
    license: str = "apache-2.0",
    dtype: str | torch.dtype | None = None,
    repo_id: str | None = None,
    target=None,
    expand_vocabulary: bool = False,
) -> Path:
    """Write a complete Hub repository folder for a drafter; returns `out_dir`.

    Args:
        drafter_path: a drafter checkpoint in either format (folder or Hub id; `load_drafter`).
        out_dir: a new or empty folder.
        target_id: the target's Hub id (card `base_model`), e.g. "HuggingFaceTB/SmolLM2-135M-Instruct".
        benchmark_json, training_record: JSON files (or dicts) for the card; validated before
            anything is written. Without them the card says that no numbers are available.
        official: also write `official/` in the official format (vLLM / SGLang).
        license: the card's `license` metadata.
        dtype: cast the written weights (e.g. "bfloat16"); default: keep the stored dtype.
        repo_id: the drafter's own Hub id for the usage snippets; when None, a placeholder that
            `push_folder` replaces with the id it pushes to.
        target: with `official` and a drafter with a pruned draft vocabulary, the target (a model, a known
            target's name or a local model folder) whose LM-head rows `official/` holds (`save_official`).
        expand_vocabulary: with `official`, write `official/` from the drafter expanded to the target's whole
            vocabulary (`expand_draft_vocabulary`: its drafts change, and the card says so): the only official
            layout of a DFlash2 drafter with a pruned draft vocabulary. The Hub-native weights stay as trained.
    """
    check_hub_id(target_id, "target_id")
    if repo_id is not None:
        check_hub_id(repo_id, "repo_id")
    # Validate every input before the first file is written.
    benchmark = load_benchmark(benchmark_json) if benchmark_json is not None else None
    record = load_training_record(training_record) if training_record is not None else None
    weights_dtype = as_dtype(dtype)
    out = Path(out_dir)
    if out.is_file():
        raise ValueError(f"{out} is a file; export into a new or empty folder.")
    with folder_lock(out, "export"):  # one writer: a second export into the same folder is refused by name
        if any(path.name != LOCK_NAME for path in out.iterdir()):
            raise ValueError(
                f"{out} exists and is not empty; export into a new or empty folder (stale files would be uploaded)."
            )
        if expand_vocabulary and not official:
            raise ValueError(
                "expand_vocabulary=True (--expand-vocabulary) changes only the official/ copy: pass official=True "
                "(--official) as well, or drop it."
            )
        drafter = load_drafter(drafter_path)
        engine_drafter = expand_draft_vocabulary(drafter) if expand_vocabulary else drafter
        head = official_head_source(engine_drafter, target) if official else None
        if official:
            official_head(engine_drafter, head)  # a drafter without an official layout is refused before any file
        with _staged(out) as staging:  # written beside `out`, moved in whole: a refusal leaves `out` as it was
            _write_export(
                drafter, staging, target_id, benchmark, record, license, weights_dtype, repo_id, head,
                engine_drafter if official else None,
            )  # fmt: skip
        return out


@contextlib.contextmanager
def _staged(out: Path):
    """A staging folder beside `out` (`.NAME.export-staging`, in its parent) for the block to write into; its
    entries move into `out` when the block succeeds, and it is removed either way. The caller holds `out`'s lock,
    so a staging folder already there is a killed export's: it is removed first."""
    staging = out.parent / f".{out.name}.export-staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        for path in sorted(staging.iterdir()):
            os.replace(path, out / path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_export(
    drafter, out: Path, target_id, benchmark, record, license, weights_dtype, repo_id, head, official_drafter
) -> None:
    """The export's files (weights, remote code, official/ from `official_drafter` when given, with the target
    head's rows `head` where it drafts over a pruned vocabulary, JSON inputs, card) into `out`."""
    weights_dtype = weights_dtype or drafter.dtype
    official = official_drafter is not None
    save_hub(drafter, out, dtype=weights_dtype, model_card=False)
    if official:
        save_official(official_drafter, out / OFFICIAL_SUBFOLDER, dtype=weights_dtype, target_lm_head=head)
    for name, data in ((BENCHMARK_NAME, benchmark), (TRAINING_RECORD_NAME, record)):
        if data is not None:
            (out / name).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    card = render_model_card(
        drafter.config,
        target_id,
        repo_id=repo_id,
        benchmark=benchmark,
        training_record=record,
        official=official,
        license=license,
        weights_dtype=str(weights_dtype).removeprefix("torch."),
        num_parameters=sum(p.numel() for p in drafter.parameters()),
        official_expanded=official and official_drafter is not drafter,
    )
    card.save(out / "README.md")


def _upload_operations(folder: Path, card: str) -> list[CommitOperationAdd]:
    """One commit's additions: every file of `folder` (minus `.git` / `.cache/huggingface`, as
    `upload_folder` skips them, and the folder's lock file), with `README.md` taken from `card` instead of the file
    on disk."""
    files = {
        path.relative_to(folder).as_posix(): path
        for path in sorted(folder.glob("**/*"))
        if path.is_file() and not path.name.endswith(LOCK_NAME)  # push's own lock
    }
    kept = filter_repo_objects(files, ignore_patterns=DEFAULT_IGNORE_PATTERNS)
    return [
        CommitOperationAdd(
            path_in_repo=name, path_or_fileobj=card.encode("utf-8") if name == "README.md" else str(files[name])
        )
        for name in kept
    ]


def push_folder(
    out_dir: str | os.PathLike,
    repo_id: str,
    private: bool = True,
    token: str | None = None,
) -> str:
    """Create `repo_id` on the Hub (private by default; an existing repo keeps its visibility) and
    upload the folder written by `export_drafter` in one commit. Returns the repository URL.

    A card exported without `repo_id` gets the id written into its usage snippets: in the upload,
    and in the local `README.md` only once the upload succeeded (a refused token or a failed upload
    leaves the folder exactly as it was). Without a token (`token=`, `HF_TOKEN` or `hf auth login`),
    or with one the Hub refuses, raises a ValueError saying how to log in.
    """
    folder = Path(out_dir)
    check_hub_id(repo_id, "repo_id")
    if folder.is_file():
        raise ValueError(f"{folder} is a file; give the folder written by `hf-dflash export`.")
    # The folder's lock for the upload and the card's rewrite: never a half-written export, nor two card rewrites.
    with folder_lock(folder, "push"):
        return _push(folder, repo_id, private, token)


def _push(folder: Path, repo_id: str, private: bool, token: str | None) -> str:
    missing = [name for name in (CONFIG_NAME, "README.md") if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"{folder} lacks {missing}; write the folder with `hf-dflash export` first.")
    token = token or huggingface_hub.get_token()
    if not token:
        raise ValueError(f"No Hugging Face token found to push {repo_id}: {LOGIN_HINT}.")

    card_file = folder / "README.md"
    card = card_file.read_text(encoding="utf-8")
    if REPO_ID_PLACEHOLDER in card:
        card = card.replace(REPO_ID_PLACEHOLDER, repo_id)
    elif f'"{repo_id}"' not in card:
        warnings.warn(
            f"{card_file} does not mention {repo_id}: its usage snippets load another repository. "
            f"Re-export with --repo-id {repo_id} (or without --repo-id) to fix them.",
            stacklevel=2,
        )

    api = huggingface_hub.HfApi(token=token)
    try:
        url = api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
        api.create_commit(
            repo_id=repo_id,
            repo_type="model",
            operations=_upload_operations(folder, card),
            commit_message="Upload DFlash drafter (hf-dflash export)",
        )
    except HfHubHTTPError as error:
        status = getattr(error.response, "status_code", None)
        if status in (401, 403):
            raise ValueError(f"The Hub refused the token for {repo_id} ({error}); {LOGIN_HINT}.") from None
        raise ValueError(f"Pushing {folder} to {repo_id} failed ({error}); {folder} is unchanged.") from None
    except OSError as error:  # no connection, offline mode
        raise ValueError(f"Pushing {folder} to {repo_id} failed ({error}); {folder} is unchanged.") from None
    if card_file.read_text(encoding="utf-8") != card:  # the folder now matches what was uploaded
        card_file.write_text(card, encoding="utf-8")
    return str(url)


__all__ = ["OFFICIAL_SUBFOLDER", "check_hub_id", "export_drafter", "push_folder"]
