"""`DFlashCandidateGenerator`: one drafter pass per round drafts a whole block."""

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel
from transformers.cache_utils import DFlashCache
from transformers.generation.candidate_generator import CandidateGenerator

from ..modeling_dflash import DFlashDraftModel
from .pairing import check_pairing
from .verification import greedy_tokens, process_draft_logits


@dataclass
class AcceptanceStats:
    """Acceptance of one `generate` call. τ of a round = accepted drafts + 1 (the bonus token)."""

    block_size: int
    acceptance_lengths: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """τ averaged over verification rounds (0.0 when no round ran)."""
        lengths = self.acceptance_lengths
        return sum(lengths) / len(lengths) if lengths else 0.0

    @property
    def histogram(self) -> list[int]:
        """histogram[t - 1] = number of rounds that committed t tokens, t = 1..block_size."""
        counts = [0] * self.block_size
        for length in self.acceptance_lengths:
            counts[length - 1] += 1
        return counts


def target_layer_features(hidden_states: tuple, target_layer_ids: list[int], rows: int) -> torch.Tensor:
    """(B, rows, n*Ht): outputs of the selected target layers (h[i + 1]) for the first `rows` tokens."""
    return torch.cat([hidden_states[i + 1][:, :rows] for i in target_layer_ids], dim=-1)


class DFlashCandidateGenerator(CandidateGenerator):
    """Drafts `block_size - 1` tokens per round from `[bonus, MASK x (block_size - 1)]`.

    Follows Transformers' DFlash contract: it needs the previous target forward's outputs
    (`requires_model_outputs`) with the hidden states of `target_layer_ids` (`model_kwargs_overrides`).
    The first call returns no candidates, so the target's prefill produces the prompt features.
    """

    requires_model_outputs = True

    def __init__(
        self,
        drafter: DFlashDraftModel,
        target: PreTrainedModel,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList | None = None,
    ):
        check_pairing(target, drafter)
        config = drafter.config
        self.drafter = drafter
        self.embedding = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.target_layer_ids = list(config.target_layer_ids)
        self.block_size = config.block_size
        self.mask_token_id = config.mask_token_id
        self.model_kwargs_overrides: dict[str, Any] = {"output_hidden_states": [i + 1 for i in self.target_layer_ids]}
        self.max_length = generation_config.max_length
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor
        self.cache = DFlashCache(config=config)
        self.context_length = 0  # tokens whose target features are in `self.cache`
        self.stats = AcceptanceStats(block_size=self.block_size)

    def get_candidates(
        self,
        input_ids: torch.LongTensor,
        model_kwargs: dict[str, Any] | None = None,
        model_outputs=None,
        is_first_iteration: bool = False,
        n_last_matches: int = 0,
        **kwargs,
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """input_ids (1, L) ends with the bonus token the target has not consumed yet.

        Returns (1, L + k) candidates and their (1, k, V) draft probabilities when sampling
        (processed draft logits when greedy), k <= block_size - 1 and never past `max_length`.
        """
        length = input_ids.shape[1]
        num_drafts = min(self.block_size - 1, self.max_length - length - 1)
        if is_first_iteration or num_drafts <= 0:
            return input_ids, None

        # Context = the accepted tokens of the last target forward, i.e. positions
        # [context_length, length - 1); the bonus token's own features do not exist yet.
        rows = length - 1 - self.context_length
        context = target_layer_features(model_outputs.hidden_states, self.target_layer_ids, rows)
        if self.context_length:
            self.cache.crop(-self.block_size)  # drop the previous block's keys/values
        self.cache.set_previous_accepted_tokens(rows)
        block_ids = torch.full((1, self.block_size), self.mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
        block_ids[:, 0] = input_ids[:, -1]
        position_ids = torch.arange(self.context_length, length - 1 + self.block_size, device=input_ids.device)
        hidden = self.drafter(
            noise_embeds=self.embedding(block_ids),
            context_hidden_states=context,
            position_ids=position_ids.unsqueeze(0),
            cache=self.cache,
        ).last_hidden_state
        self.context_length = length - 1

        logits = process_draft_logits(self.logits_processor, input_ids, self.lm_head(hidden[:, 1 : 1 + num_drafts]))
        if self.do_sample:
            probs = logits.softmax(-1)
            drafts = torch.multinomial(probs[0], 1).view(1, -1)
            return torch.cat([input_ids, drafts], dim=-1), probs
        return torch.cat([input_ids, greedy_tokens(logits)], dim=-1), logits

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        """Record τ = num_matches + 1 for the round that was just verified."""
        self.stats.acceptance_lengths.append(num_matches + 1)
