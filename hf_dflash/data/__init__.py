"""Training data for DFlash drafters: prompt sources, corpus, regeneration by the target, tokenisation."""

from .corpus import build_corpus, read_prompts_file
from .pipeline import prepare_data
from .regenerate import regenerate_responses
from .sources import EVAL_SOURCES, TRAIN_SOURCES, MissingDataPackageError, load_eval_suite, load_source
from .tokenize import tokenize_conversation, tokenize_responses

__all__ = [
    "EVAL_SOURCES",
    "TRAIN_SOURCES",
    "MissingDataPackageError",
    "build_corpus",
    "load_eval_suite",
    "load_source",
    "prepare_data",
    "read_prompts_file",
    "regenerate_responses",
    "tokenize_conversation",
    "tokenize_responses",
]
