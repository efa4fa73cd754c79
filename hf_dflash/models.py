"""Deprecated: `hf_dflash.models` is now `hf_dflash.targets` (the target registry); this module goes away in 0.2.0.

Every name it had still imports from here, as the same object `hf_dflash.targets` holds, with a FutureWarning:

    from hf_dflash.models import load_target   # FutureWarning: import it from hf_dflash.targets
    from hf_dflash.targets import load_target  # the same function
"""

import warnings

import hf_dflash.targets as targets

RENAMED_TO = "hf_dflash.targets"
REMOVED_IN = "0.2.0"
# The names the module had (its functions, classes and constants), all still defined in hf_dflash.targets.
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
]
OLD_NAMES = frozenset(__all__) | {
    "CACHE_ENV_VAR",
    "MARKER_FILE",
    "get_spec",
    "locate_gguf_parts",
    "gguf_source",
    "resolve_device",
    "is_converted",
    "convert_gguf",
    "make_readable",
    "gguf_options",
    "strip_gguf_quantizer",
    "discard",
}


def __getattr__(name: str):
    """`hf_dflash.targets.<name>` for an old name, with a FutureWarning at the caller's line (PEP 562)."""
    if name not in OLD_NAMES:
        raise AttributeError(f"module 'hf_dflash.models' has no attribute {name!r} (it is now {RENAMED_TO})")
    warnings.warn(
        f"hf_dflash.models is deprecated and will be removed in {REMOVED_IN}: import {name} from {RENAMED_TO}.",
        FutureWarning,
        stacklevel=2,
    )
    return getattr(targets, name)
