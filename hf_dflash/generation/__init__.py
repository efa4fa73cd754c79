from .adaptive import AdaptiveBlockSize
from .candidate_generator import DFlashCandidateGenerator
from .confidence import ConfidentPrefix
from .cost_model import CostModel
from .decoding import DFlashGenerateOutput, dflash_decoding
from .pairing import check_pairing
from .stats import AcceptanceStats

__all__ = [
    "AcceptanceStats",
    "AdaptiveBlockSize",
    "ConfidentPrefix",
    "CostModel",
    "DFlashCandidateGenerator",
    "DFlashGenerateOutput",
    "check_pairing",
    "dflash_decoding",
]
