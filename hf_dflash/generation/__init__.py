from .candidate_generator import DFlashCandidateGenerator
from .decoding import DFlashGenerateOutput, dflash_decoding
from .pairing import check_pairing
from .policies.block_size import AdaptiveBlockSize
from .policies.confidence import ConfidentPrefix
from .policies.cost_model import CostModel
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
