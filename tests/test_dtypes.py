"""dtype="auto": bf16 only where the hardware multiplies it natively; every command defaults to it."""

import pytest
import torch

from hf_dflash import dtypes
from hf_dflash.cli import build_parser
from hf_dflash.dtypes import choose_dtype, describe_dtype, resolve_dtype

ZEN3 = {"fpu", "sse2", "avx", "avx2", "fma", "f16c"}  # AMD EPYC Zen 3: no native bf16
SAPPHIRE_RAPIDS = ZEN3 | {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
NEOVERSE_V1 = {"fp", "asimd", "sve", "bf16", "i8mm"}  # Arm with FEAT_BF16


@pytest.mark.parametrize(
    "flags,expected,reason",
    [
        (ZEN3, torch.float32, "without native bf16"),
        (ZEN3 | {"avx512f", "avx512bw"}, torch.float32, "without native bf16"),  # AVX-512 alone is not bf16
        (SAPPHIRE_RAPIDS, torch.bfloat16, "avx512_bf16/amx_bf16"),
        (ZEN3 | {"avx512_bf16"}, torch.bfloat16, "avx512_bf16"),  # Zen 4
        (NEOVERSE_V1, torch.bfloat16, "bf16"),
    ],
)
def test_cpu_choice_follows_the_bf16_flags(flags, expected, reason):
    choice = choose_dtype("cpu", flags=flags)
    assert choice.dtype == expected and reason in choice.reason


def test_unreadable_cpu_flags_fall_back_to_float32(monkeypatch):
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: None)
    choice = choose_dtype("cpu")
    assert choice.dtype == torch.float32 and "unreadable" in choice.reason


def test_cuda_prefers_bf16_and_falls_back_to_fp16():
    assert choose_dtype("cuda", cuda_bf16=True).dtype == torch.bfloat16
    assert choose_dtype(torch.device("cuda:1"), cuda_bf16=False).dtype == torch.float16


@pytest.mark.parametrize("device", ["mps", "xpu", "meta"])
def test_auto_on_a_device_we_cannot_judge_names_it(device):
    with pytest.raises(ValueError, match=f"device '{device}'.*explicit dtype"):
        choose_dtype(device)


def test_unknown_device_string_is_a_value_error():
    with pytest.raises(ValueError, match="unknown device 'gpu0'"):
        choose_dtype("gpu0")


def test_resolve_and_describe(monkeypatch):
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: frozenset(SAPPHIRE_RAPIDS))
    assert resolve_dtype("auto") is torch.bfloat16
    assert describe_dtype("auto") == "bfloat16 (CPU with native bf16 (avx512_bf16/amx_bf16))"
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: frozenset(ZEN3))
    assert resolve_dtype("auto") is torch.float32
    assert describe_dtype("fp32") == "float32 (as requested)"
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="'float7'"):
        resolve_dtype("float7")


def test_this_machine_gets_a_decision_with_a_reason():
    choice = choose_dtype("cpu")
    assert choice.dtype in (torch.float32, torch.bfloat16) and choice.reason


@pytest.mark.parametrize(
    "argv,field",
    [
        (["demo"], "dtype"),
        (["generate", "--prompts", "p.jsonl", "--out", "o.jsonl"], "dtype"),
        (["bench", "--drafter", "random"], "dtype"),
        (["prepare-data", "--out", "o"], "dtype"),
        (["cache-features", "--data", "d", "--out", "o"], "target_dtype"),
    ],
)
def test_every_command_defaults_to_auto(argv, field):
    assert getattr(build_parser().parse_args(argv), field) == "auto"
