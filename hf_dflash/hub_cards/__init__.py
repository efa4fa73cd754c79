"""What a published drafter says about itself: model cards (`template.md`), the training record and the
benchmark / training-record JSON schemas. The repository folder and the push are in
`hf_dflash.checkpoints.publish`:

    hf-dflash export out/drafter out/repo --target-id HuggingFaceTB/SmolLM2-135M-Instruct \
        --benchmark out/bench.json --training-record out/drafter/training_record.json --official
    hf-dflash push out/repo --repo-id me/SmolLM2-135M-Instruct-DFlash
"""

from .card import REPO_ID_PLACEHOLDER, TAGS, render_model_card, short_model_card
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
    "REPO_ID_PLACEHOLDER",
    "TAGS",
    "TRAINING_RECORD_NAME",
    "TrainingRecordCallback",
    "load_benchmark",
    "load_training_record",
    "record_data_from_prepare_data",
    "render_model_card",
    "short_model_card",
    "validate_benchmark",
    "validate_training_record",
    "write_training_record",
]
