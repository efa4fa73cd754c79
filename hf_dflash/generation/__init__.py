from .adaptive import AdaptiveBlockSize
from .candidate_generator import AcceptanceStats, DFlashCandidateGenerator
from .cost_model import CostModel
from .decoding import DFlashGenerateOutput, dflash_decoding
from .pairing import check_pairing

__all__ = [
    "AcceptanceStats",
    "AdaptiveBlockSize",
    "CostModel",
    "DFlashCandidateGenerator",
    "DFlashGenerateOutput",
    "check_pairing",
    "dflash_decoding",
]
