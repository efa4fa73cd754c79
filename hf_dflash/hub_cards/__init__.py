"""Publishing drafters on the Hub: model cards (`template.md`), repository folders and pushes.

    hf-dflash export out/drafter out/repo --target-id HuggingFaceTB/SmolLM2-135M-Instruct \
        --benchmark out/bench.json --training-record out/drafter/training_record.json --official
    hf-dflash push out/repo --repo-id me/SmolLM2-135M-Instruct-DFlash
"""

from .card import REPO_ID_PLACEHOLDER, TAGS, render_model_card
from .export import OFFICIAL_SUBFOLDER, export_drafter, push_folder
from .record import TrainingRecordCallback, record_data_from_prepare_data, write_training_record
from .schemas import (
    BENCHMARK_NAME,
    TRAINING_RECORD_NAME,
    load_benchmark,
    load_training_record,
    validate_benchmark,
    validate_training_record,
)

__all__ = [
    "BENCHMARK_NAME",
    "OFFICIAL_SUBFOLDER",
    "REPO_ID_PLACEHOLDER",
    "TAGS",
    "TRAINING_RECORD_NAME",
    "TrainingRecordCallback",
    "export_drafter",
    "load_benchmark",
    "load_training_record",
    "push_folder",
    "record_data_from_prepare_data",
    "render_model_card",
    "validate_benchmark",
    "validate_training_record",
    "write_training_record",
]
