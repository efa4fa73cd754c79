"""Helpers shared by the compiled-generation tests: a CPU compile config, a spy on the compiled rounds' widths,
and a compiled DFlash `generate` call (static cache + compile_config)."""

import torch
from transformers import CompileConfig


def cpu_compile_config() -> CompileConfig:
    config = CompileConfig(dynamic=False)
    config._compile_all_devices = True  # transformers compiles the decoding step on accelerators only otherwise
    return config


class WidthSpy:
    """Wraps `target.get_compiled_call` so the test sees the width of every compiled round."""

    def __init__(self, target):
        self.widths: list[int] = []
        original = target.get_compiled_call

        def get_compiled_call(config):
            compiled = original(config)

            def call(**inputs):
                self.widths.append(inputs["input_ids"].shape[1])
                return compiled(**inputs)

            return call

        target.get_compiled_call = get_compiled_call


def compiled_dflash(target, drafter, input_ids, max_new_tokens: int, **kwargs) -> torch.LongTensor:
    return target.generate(
        input_ids,
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        assistant_model=drafter,
        cache_implementation="static",
        compile_config=cpu_compile_config(),
        **kwargs,
    )
