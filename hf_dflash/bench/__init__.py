"""`hf-dflash bench`: plain decoding, our DFlash loop, Transformers' built-in DFlash loop and prompt lookup,
side by side on the evaluation suite or your prompts (τ, histograms, tokens/s, speed-up, exactness)."""

from .card import benchmark_card
from .command import run_bench
from .divergence import Divergence, divergence_note, first_divergence
from .loading import BenchModels, load_bench_models, machine_description, random_drafter
from .methods import METHODS, Generation, generate_with
from .plots import write_plots
from .prompts import EVAL_SETS, load_prompt_sets
from .report import build_report, format_table, write_report
from .runner import Sample, run_benchmark
from .summary import summarize

__all__ = [
    "EVAL_SETS",
    "METHODS",
    "BenchModels",
    "Divergence",
    "Generation",
    "Sample",
    "benchmark_card",
    "build_report",
    "divergence_note",
    "first_divergence",
    "format_table",
    "generate_with",
    "load_bench_models",
    "load_prompt_sets",
    "machine_description",
    "random_drafter",
    "run_bench",
    "run_benchmark",
    "summarize",
    "write_plots",
    "write_report",
]
