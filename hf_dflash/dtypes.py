"""Which dtype is fast on this machine: `dtype="auto"` everywhere a dtype is chosen.

bf16 only pays where the hardware multiplies bf16 natively. Measured with SmolLM2-135M on 2 cores:
on an AMD EPYC with AVX2 and no native bf16 a 16-token bf16 forward costs 2.4x the fp32 one (305 vs
129 ms) and batched greedy runs at 40 vs 149 tok/s; on an Intel Xeon with AMX/AVX-512 bf16, batched
greedy runs at 274 tok/s in bf16 vs 121 in fp32. So:

  - CUDA: bfloat16 where the GPU supports it, else float16;
  - CPU: bfloat16 where the processor has native bf16 matrix instructions (x86 `avx512_bf16` or
    `amx_bf16`; Arm `bf16`), else float32;
  - any other device: no guess, a ValueError asks for an explicit dtype.

    >>> choice = choose_dtype("cpu")
    >>> choice.dtype, choice.reason
    (torch.float32, 'CPU without native bf16 (no avx512_bf16/amx_bf16 flag): float32 is faster')
"""

from __future__ import annotations

import platform
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

__all__ = ["AUTO", "DtypeChoice", "choose_dtype", "cpu_flags", "describe_dtype", "resolve_dtype"]

AUTO = "auto"
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 AVX-512 BF16 / AMX; Arm BF16 (FEAT_BF16)
ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16", "float": "float32"}


@dataclass(frozen=True)
class DtypeChoice:
    """A dtype and why it was chosen (printed once by the commands)."""

    dtype: torch.dtype
    reason: str

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')} ({self.reason})"


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str] | None:
    """The processor's feature flags (Linux `/proc/cpuinfo`, macOS `sysctl`), or None if unreadable."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        flags: set[str] = set()
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip().lower() in ("flags", "features"):  # x86 / Arm
                flags.update(value.split())
        return frozenset(flags)
    if platform.system() == "Darwin":
        try:
            value = subprocess.run(
                ["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True, timeout=5
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
        return frozenset({"bf16"} if value == "1" else ())
    return None


def choose_dtype(
    device: torch.device | str = "cpu",
    *,
    flags: frozenset[str] | set[str] | None = None,
    cuda_bf16: bool | None = None,
) -> DtypeChoice:
    """The fast inference dtype for `device`, with the reason.

    Args:
        device: "cpu", "cuda", "cuda:1", or a torch.device.
        flags: CPU feature flags (default: read from the machine; for tests).
        cuda_bf16: whether the GPU supports bf16 (default: asked from torch; for tests).

    Raises:
        ValueError: a device type other than cpu/cuda (pass an explicit dtype there).
    """
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        raise ValueError(f"dtype='auto' got an unknown device {device!r}; use 'cpu' or 'cuda'.") from None
    if kind == "cuda":
        if cuda_bf16 is None:
            cuda_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        if cuda_bf16:
            return DtypeChoice(torch.bfloat16, "CUDA GPU with bf16 support")
        return DtypeChoice(torch.float16, "CUDA GPU without bf16 support")
    if kind != "cpu":
        raise ValueError(
            f"dtype='auto' does not know which dtype is fast on device {str(device)!r}; pass an explicit dtype "
            "(e.g. --dtype float16 or --dtype float32)."
        )
    flags = cpu_flags() if flags is None else frozenset(flags)
    if flags is None:
        return DtypeChoice(torch.float32, "CPU flags unreadable, so native bf16 cannot be confirmed: float32")
    native = [flag for flag in BF16_CPU_FLAGS if flag in flags]
    if native:
        return DtypeChoice(torch.bfloat16, f"CPU with native bf16 ({'/'.join(native)})")
    return DtypeChoice(torch.float32, "CPU without native bf16 (no avx512_bf16/amx_bf16 flag): float32 is faster")


def resolve_dtype(dtype: torch.dtype | str, device: torch.device | str = "cpu") -> torch.dtype:
    """torch.dtype from a dtype, its name ("bfloat16", "torch.float16", "fp32", ...) or "auto" (for `device`)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if str(dtype) == AUTO:
        return choose_dtype(device).dtype
    key = str(dtype).removeprefix("torch.")
    resolved = getattr(torch, ALIASES.get(key, key), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"Unknown dtype {dtype!r}; use 'auto', a torch.dtype or a name such as 'bfloat16'.")
    return resolved


def describe_dtype(dtype: torch.dtype | str, device: torch.device | str = "cpu") -> str:
    """'bfloat16 (CPU with native bf16 (amx_bf16))' for "auto", 'float32 (as requested)' otherwise."""
    if str(dtype) == AUTO:
        return str(choose_dtype(device))
    return f"{str(resolve_dtype(dtype)).removeprefix('torch.')} (as requested)"
