"""`DFlashCandidateGenerator`: the DFlash drafter behind Transformers' `CandidateGenerator` contract.

Our own loop (`decoding.py`) drives its drafting strategies for any batch size. This adapter of the chain
strategy serves loops written to Transformers' contract (its `_assisted_decoding`, batch size 1): it
needs the previous target forward's outputs (`requires_model_outputs`) with the hidden states of
`target_layer_ids` (`model_kwargs_overrides`); the first call returns no candidates, so the target's
prefill produces the prompt features; later calls draft one block from the features of the tokens the
last forward accepted.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel
from transformers.generation.candidate_generator import CandidateGenerator

from ..modeling_dflash import DFlashDraftModel
from ..target_features import target_layer_features
from .drafting.block_drafter import BlockDrafter
from .drafting.strategies import ChainDrafting
from .pairing import check_pairing
from .policies.block_size import BlockSizeController, FixedBlockSize
from .rows import Rows
from .stats import AcceptanceStats


class DFlashCandidateGenerator(CandidateGenerator):
    """The chain strategy (`drafting/strategies/chain.py`) behind Transformers' contract: drafts k - 1 tokens per round
    from `[bonus, MASK x (k - 1)]`, k = block_size unless a `block_size_controller` chooses k <= block_size each
    round (k = 1: no drafter pass), never past `max_length`. Candidate logits: greedy with logits processors,
    the processed draft logits; sampling, the log of the distributions the drafts were drawn from (a DFlash2
    selector's walk draws each slot given the one before), which Transformers' rejection test softmaxes back."""

    requires_model_outputs = True

    def __init__(
        self,
        drafter: DFlashDraftModel,
        target: PreTrainedModel,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList | None = None,
        block_size_controller: BlockSizeController | None = None,
    ):
        check_pairing(target, drafter)
        controller = block_size_controller or FixedBlockSize(drafter.config.block_size)
        self.do_sample = bool(generation_config.do_sample)
        self.chain = ChainDrafting(BlockDrafter(drafter, target), controller, self.do_sample, logits_processor)
        self.target_layer_ids = list(drafter.config.target_layer_ids)
        self.model_kwargs_overrides: dict[str, Any] = {"output_hidden_states": [i + 1 for i in self.target_layer_ids]}
        self.max_length = generation_config.max_length
        self.processed = bool(self.do_sample or logits_processor)
        self.features_length = 0  # tokens whose target features were read (given to the drafter or pending)
        self.num_drafts = 0  # drafts offered in the current round
        self.in_round = False  # the last get_candidates call was a round (not the prefill)
        self.stats = AcceptanceStats(block_size=drafter.config.block_size)
        self.block_size = drafter.config.block_size  # controllers choose k <= block_size

    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict[str, Any] | None = None,
        model_outputs=None,
        is_first_iteration: bool = False,
        n_last_matches: int = 0,
        **kwargs,
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """input_ids (1, L) ends with the bonus token the target has not read yet. Returns (1, L + d)
        candidates and their (1, d, V) processed draft logits (None when plain greedy); d = 0 returns
        input_ids and None."""
        self.in_round = not is_first_iteration
        if is_first_iteration:
            return input_ids, None
        # The last target forward read positions [features_length, L - 1): the accepted tokens (the bonus
        # token's own features do not exist yet). Rounds without a drafter pass leave theirs pending.
        rows = input_ids.shape[1] - 1 - self.features_length
        features = target_layer_features(model_outputs.hidden_states, self.target_layer_ids, rows)
        self.chain.block.add_context(features, input_ids.new_ones(features.shape[:2]))
        self.features_length = input_ids.shape[1] - 1

        block_length = self.chain.controller.choose([0])
        self.stats.block_sizes.append(block_length)
        proposal = self.chain.draft_block(Rows(input_ids, self.max_length, 0, False), block_length, [input_ids[0]])
        self.num_drafts = proposal.num_drafts
        if not self.num_drafts:
            return input_ids, None
        drafts = proposal.drafts
        if self.do_sample:  # Transformers' rejection test takes q = softmax(candidate logits): give it log q
            return torch.cat([input_ids, drafts.tokens], dim=-1), drafts.scores.log()
        return torch.cat([input_ids, drafts.tokens], dim=-1), drafts.scores if self.processed else None

    @property
    def num_drafting_tokens(self) -> int:
        """The widest round: a verification reads the bonus token and up to block_size - 1 drafts. Transformers
        >= 5.25 asks this before its loop, to record enough past states to roll a round back."""
        return self.block_size

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        """Record τ = num_matches + 1 for the round just verified; the controller learns from it."""
        if not self.in_round:
            return
        self.stats.acceptance_lengths.append(num_matches + 1)
        self.chain.controller.observe([0], self.num_drafts, torch.tensor([num_matches]))
