"""`DFlashCandidateGenerator`: one drafter pass per round drafts a whole block; with hybrid drafting
(`prompt_lookup_num_tokens` beside a DFlash assistant) an n-gram continuation joins it as a second
branch of a draft tree (`tree.py`)."""

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel
from transformers.cache_utils import DFlashCache
from transformers.generation.candidate_generator import CandidateGenerator

from ..modeling_dflash import DFlashDraftModel
from ..target_features import target_layer_features
from .adaptive import BlockSizeController, FixedBlockSize, TreeBudget
from .ngram import PromptLookup
from .pairing import check_pairing
from .tree import DraftTree, merge_branches
from .verification import greedy_tokens, process_draft_logits


@dataclass
class AcceptanceStats:
    """Acceptance of one `generate` call. τ of a round = accepted drafts + 1 (the bonus token).

    acceptance_lengths: τ of every verification round (batched: of every row in every round);
    block_sizes: the block length k of every round (k - 1 drafts offered; 1 = no drafter pass), which
    is `block_size` unless `drafter.block_size_policy` chose otherwise.
    Hybrid drafting (batch size 1) also records, per verification round: tree_sizes, the nodes verified
    (bonus + DFlash drafts + n-gram drafts, shared prefixes once); block_tokens and ngram_tokens, the
    accepted drafts that each branch had drafted (a shared prefix counts for both). Its prefill may verify
    n-gram drafts: then it is a round too (`first_round_in_prefill`), as in prompt lookup.
    """

    block_size: int
    acceptance_lengths: list[int] = field(default_factory=list)
    block_sizes: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    block_tokens: list[int] = field(default_factory=list)
    ngram_tokens: list[int] = field(default_factory=list)
    first_round_in_prefill: bool = False  # hybrid: the prefill verified n-gram drafts (round 0 is the prefill)

    @property
    def mean_acceptance_length(self) -> float:
        """τ averaged over verification rounds (0.0 when no round ran)."""
        lengths = self.acceptance_lengths
        return sum(lengths) / len(lengths) if lengths else 0.0

    @property
    def histogram(self) -> list[int]:
        """histogram[t - 1] = number of rounds that committed t tokens, t = 1..block_size (further when hybrid
        drafting accepted an n-gram branch deeper than the block)."""
        counts = [0] * max([self.block_size, *self.acceptance_lengths])
        for length in self.acceptance_lengths:
            counts[length - 1] += 1
        return counts


class DFlashCandidateGenerator(CandidateGenerator):
    """Drafts k - 1 tokens per round from `[bonus, MASK x (k - 1)]`, k = block_size unless a
    `block_size_controller` chooses k <= block_size each round (k = 1: no drafter pass).

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
        block_size_controller: BlockSizeController | None = None,
        prompt_lookup: PromptLookup | None = None,
        tree_budget: TreeBudget | None = None,
    ):
        check_pairing(target, drafter)
        if (prompt_lookup is None) != (tree_budget is None):
            raise ValueError("Hybrid drafting needs both prompt_lookup and tree_budget (or neither).")
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
        self.controller = block_size_controller or FixedBlockSize(self.block_size)
        self.cache = DFlashCache(config=config)
        self.context_length = 0  # tokens whose target features are in `self.cache`
        self.features_length = 0  # tokens whose target features were read (cached or pending)
        self.pending: torch.Tensor | None = None  # (1, P, n*Ht) features read but not yet given to the drafter
        self.block_length = 0  # tokens of the block whose keys/values end `self.cache`
        self.num_drafts = 0  # drafts offered in the current round
        self.stats = AcceptanceStats(block_size=self.block_size)
        self.prompt_lookup = prompt_lookup
        self.tree_budget = tree_budget
        self.target_vocab_size = target.get_output_embeddings().weight.shape[0]
        self.ngram_found: torch.LongTensor | None = None  # the n-gram continuation found this round
        # The candidates just returned as a tree: a chain unless both branches drafted (greedy hybrid).
        self.tree: DraftTree | None = None

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

        Returns (1, L + d) candidates and their (1, d, V) draft probabilities when sampling
        (processed draft logits when greedy with logits processors, None without), d = k - 1 for the k
        the controller chose, never past
        `max_length`; d = 0 (no drafter pass) returns input_ids and None.
        Hybrid drafting: the candidates after input_ids are the nodes 1..N-1 of `self.tree` (the block's
        drafts, then the n-gram drafts not shared with them); the n-gram chain alone comes with one-hot
        draft probabilities when sampling; a tree of two branches (greedy only) with None.
        """
        length = input_ids.shape[1]
        self.tree = None
        if is_first_iteration:
            if self.prompt_lookup is None:
                return input_ids, None
            # Hybrid: the prefill may verify n-gram drafts (the block needs the prompt's features first).
            block_length, ngram = self.choose_drafts(input_ids, block_allowed=False)
            if not len(ngram):
                return input_ids, None
            self.stats.block_sizes.append(block_length)
            self.stats.first_round_in_prefill = True
            return self.candidates(input_ids, input_ids[:, :0], None, ngram)
        # The last target forward covered positions [features_length, length - 1) (the accepted tokens;
        # the bonus token's own features do not exist yet). Rounds without a drafter pass leave theirs pending.
        rows = length - 1 - self.features_length
        features = target_layer_features(model_outputs.hidden_states, self.target_layer_ids, rows)
        self.pending = features if self.pending is None else torch.cat([self.pending, features], 1)
        self.features_length = length - 1

        block_length, ngram = self.choose_drafts(input_ids)
        self.stats.block_sizes.append(block_length)
        self.num_drafts = num_drafts = max(0, min(block_length - 1, self.max_length - length - 1))
        if not num_drafts:
            return self.candidates(input_ids, input_ids[:, :0], None, ngram)

        context, self.pending = self.pending, None
        if self.block_length:
            self.cache.crop(-self.block_length)  # drop the previous block's keys/values
        self.cache.set_previous_accepted_tokens(context.shape[1])
        block_ids = torch.full((1, block_length), self.mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
        block_ids[:, 0] = input_ids[:, -1]
        position_ids = torch.arange(self.context_length, length - 1 + block_length, device=input_ids.device)
        hidden = self.drafter(
            noise_embeds=self.embedding(block_ids),
            context_hidden_states=context,
            position_ids=position_ids.unsqueeze(0),
            cache=self.cache,
        ).last_hidden_state
        self.context_length, self.block_length = length - 1, block_length

        hidden = hidden[:, 1 : 1 + num_drafts]
        if not self.do_sample and not self.logits_processor:  # plain greedy: no full-vocabulary logits needed
            return self.candidates(input_ids, self.drafter.greedy_draft_tokens(hidden, self.lm_head), None, ngram)
        draft_logits = self.drafter.draft_logits(hidden, self.lm_head)  # (1, d, V)
        logits = process_draft_logits(self.logits_processor, input_ids, draft_logits)
        if self.do_sample:
            probs = logits.softmax(-1)
            drafts = torch.multinomial(probs[0], 1).view(1, -1)
            return self.candidates(input_ids, drafts, probs, ngram)
        return self.candidates(input_ids, greedy_tokens(logits), logits, ngram)

    def choose_drafts(self, input_ids: torch.LongTensor, block_allowed: bool = True) -> tuple[int, torch.LongTensor]:
        """The block length k and the n-gram drafts (m,) of this round (none without prompt lookup)."""
        if self.prompt_lookup is None:
            return self.controller.choose([0]), input_ids[0, :0]
        self.ngram_found, match_length = self.prompt_lookup.draft(
            input_ids[0], self.max_length - input_ids.shape[1] - 1
        )
        block_length, num_ngram = self.tree_budget.choose(len(self.ngram_found), block_allowed, match_length)
        return block_length, self.ngram_found[:num_ngram]

    def candidates(
        self,
        input_ids: torch.LongTensor,
        drafts: torch.LongTensor,
        scores: torch.Tensor | None,
        ngram: torch.LongTensor,
    ) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Candidates of the round from the block's drafts (1, d) with their scores and the n-gram drafts (m,)."""
        if self.prompt_lookup is not None:
            self.tree = merge_branches(int(input_ids[0, -1]), [drafts[0], ngram])
        if not len(ngram):
            return torch.cat([input_ids, drafts], dim=-1), scores
        if not drafts.shape[1]:
            # a deterministic draft: q = one-hot, so rejection sampling accepts it with probability p(draft)
            one_hot = (
                torch.nn.functional.one_hot(ngram, self.target_vocab_size).float()[None] if self.do_sample else None
            )
            return torch.cat([input_ids, ngram[None]], dim=-1), one_hot
        if self.do_sample:
            raise RuntimeError("Sampling verifies one branch: the tree budget must not choose both.")
        return torch.cat([input_ids, self.tree.tokens[None, 1:]], dim=-1), None

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int):
        """Record τ = num_matches + 1 for the round that was just verified; the controller learns from it.

        input_ids ends with the round's num_matches + 1 committed tokens."""
        self.stats.acceptance_lengths.append(num_matches + 1)
        if self.prompt_lookup is None:
            self.controller.observe([0], self.num_drafts, torch.tensor([num_matches]))
            return
        committed = input_ids[0, input_ids.shape[1] - num_matches - 1 :]
        block = self.tree.tokens[list(self.tree.branches[0])]
        self.stats.tree_sizes.append(self.tree.num_nodes)
        self.stats.block_tokens.append(agreement(block, committed[:num_matches]))
        self.stats.ngram_tokens.append(
            agreement(self.tree.tokens[list(self.tree.branches[1])], committed[:num_matches])
        )
        # Each branch's drafts against the committed tokens, bonus included: for the n-gram branch also
        # the drafts found but left out of the tree (whether the target would have accepted them).
        block_compared, ngram_compared = min(len(block), len(committed)), min(len(self.ngram_found), len(committed))
        self.tree_budget.observe(
            block_compared, agreement(block, committed), ngram_compared, agreement(self.ngram_found, committed)
        )


def agreement(drafts: torch.LongTensor, committed: torch.LongTensor) -> int:
    """Length of the common prefix of drafts (d,) and committed (c,): the drafts the target accepted."""
    length = min(len(drafts), len(committed))
    mismatch = (drafts[:length] != committed[:length]).int()
    return int((mismatch.cumsum(0) == 0).sum())
