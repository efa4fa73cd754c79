"""The one DFlash decoding loop that `generate` runs when the assistant is a DFlash drafter.

It keeps `generate`'s own preparation (generation config, logits processors, stopping criteria, cache,
streamer) and serves any batch size. Every round is the same five steps over the active rows:

    draft    one drafter pass drafts a block `[bonus, MASK x (k-1)]` for every row (`drafting.py`);
             hybrid drafting (batch 1) joins an n-gram continuation as a second branch of a tree
    verify   ONE target forward over [unread tokens, drafts] (the prompt on the first round; a tree
             forward with its mask and depth positions when two branches drafted)
    accept   the longest prefix each row's target agrees with (greedy; trees: the longest path), or
             Leviathan rejection sampling (`verification.py`)
    commit   each row's tokens one by one up to its first stop (EOS, stop string, length, time, custom),
             so a stop met inside an accepted block ends the output exactly where plain decoding does
    rollback the cache slots of rejected drafts become holes (batch N: masked like left padding, the
             tail common to all rows cropped, compacted when holes pile up; a static cache keeps its
             finished rows idle and compacts only when a round would not fit) or are cropped (batch 1);
             the accepted slots' target features become the drafter's next context

With a static cache and `compile_config` (`compiled_verification`), every round after the prefill verifies
one width with the compiled forward (padded; trees and chains alike through the tree mask when trees may
come), so one graph serves the call.

Batch 1 is the case where every slot is valid. Lossless by construction: a row sees exactly the keys
and positions plain decoding gives it, and every token it commits is the target's own choice
(greedy) or distributed as the target's (sampling). Beyond Transformers' built-in loop (5.23-5.24):
any batch size; drafts never extend past `max_length`; logits processors run once over a block when
they do not read input_ids; `return_dict_in_generate` with scores, logits and hidden states (batch 1);
acceptance statistics (`DFlashGenerateOutput.acceptance_lengths`, `drafter.last_acceptance`); a block
length chosen each round (`drafter.block_size_policy`, `adaptive.py`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import transformers
from transformers import GenerationConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache, StaticCache, StaticLayer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..caches import compact_cache, needs_compaction
from ..modeling_dflash import DFlashDraftModel
from ..target_features import target_layer_features
from .adaptive import FixedBlockSize, block_size_controller
from .drafting import BlockDrafter, Drafts
from .hybrid import HybridDrafting, verifies_trees
from .pairing import check_pairing
from .stats import AcceptanceStats
from .tree import (
    DraftTree,
    chain_parents,
    greedy_tree_path,
    keep_tree_path,
    padded_parents,
    process_tree_logits,
    sampled_tree_path,
    tree_attention_bias,
    tree_depths,
)
from .tree_drafting import remember_compiled_size, tree_drafting
from .verification import (
    accepted_lengths,
    count_until_stop,
    greedy_tokens,
    process_rows,
    row_copies,
    sample_rows,
)

# Transformers 5.24 renamed the output's `past_key_values` field to `cache`.
CACHE_FIELD = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"


@dataclass
class RoundDraft:
    """What a round verifies: drafts (B, d) after each row's bonus token, the tree they form (batch 1: a
    drafter tree, or the two branches of hybrid drafting; None for chains), the block length k of the drafter
    pass and the block's draft slots it filled (0: no drafter pass)."""

    drafts: Drafts
    tree: DraftTree | None
    block_length: int
    slots: int


@dataclass
class Verdict:
    """What the target decided in a round: new_tokens (B, d+1), row b's valid up to n_b + 1; num_accepted
    n_b (B,); the processed and raw target logits (B, d+1, V) and the forward's hidden states, laid out
    along the accepted path when a tree was verified (`path`: its nodes, root first)."""

    new_tokens: torch.LongTensor
    num_accepted: torch.LongTensor
    processed: torch.Tensor
    raw_logits: torch.Tensor
    hidden_states: tuple
    path: list[int] | None = None


@dataclass
class DFlashGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus `acceptance_lengths` (τ of each verification round)."""

    acceptance_lengths: list[int] | None = None


def dflash_decoding(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    synced_gpus: bool = False,
    streamer=None,
    inputs_tensor=None,
    assistant_model=None,
    assistant_tokenizer=None,
    tokenizer=None,
    **model_kwargs,
):
    """Same signature and return types as `GenerationMixin._assisted_decoding`, for any batch size
    (left-padded prompts with their attention mask)."""
    check_decoding_options(model, input_ids.shape[0], generation_config, streamer)
    check_pairing(model, assistant_model)
    cache_key = "cache" if "cache" in model_kwargs else "past_key_values"
    cache = model_kwargs.get(cache_key)
    check_cache(cache, assistant_model, generation_config, input_ids.shape[0])
    cache.activate_past_recording()  # sliding-window layers must be able to roll back rejected drafts
    with torch.no_grad():
        loop = DecodingLoop(model, assistant_model, logits_processor, stopping_criteria, generation_config, streamer)
        sequences = loop.run(input_ids, cache_key, model_kwargs)
    assistant_model.last_acceptance = loop.stats
    if not generation_config.return_dict_in_generate:
        return sequences
    return DFlashGenerateOutput(
        sequences=sequences,
        scores=loop.scores,
        logits=loop.raw_logits,
        hidden_states=loop.hidden_states,
        # rows that finished early left the cache: it is returned only when it still holds every row
        **{CACHE_FIELD: cache if input_ids.shape[0] == 1 else None},
        acceptance_lengths=list(loop.stats.acceptance_lengths),
    )


def check_decoding_options(model, batch_size: int, generation_config, streamer) -> None:
    """Refuse, with the reason, what DFlash decoding does not support."""
    if generation_config.output_attentions:
        raise ValueError("output_attentions=True is not supported with a DFlash assistant; drop it.")
    if model.config.is_encoder_decoder:
        raise ValueError("DFlash drafters serve decoder-only targets; this target is encoder-decoder.")
    if batch_size == 1:
        return
    if generation_config.prompt_lookup_num_tokens is not None:
        raise ValueError(
            f"Hybrid drafting (prompt_lookup_num_tokens={generation_config.prompt_lookup_num_tokens} with a DFlash "
            f"assistant) supports batch size 1, got {batch_size} prompts: generate them one by one, or "
            "drop prompt_lookup_num_tokens for batched DFlash."
        )
    if streamer is not None:
        raise ValueError("Streamers need batch size 1 with a DFlash assistant; drop `streamer` or pass one prompt.")
    wanted = [
        name for name in ("output_scores", "output_logits", "output_hidden_states") if getattr(generation_config, name)
    ]
    if wanted and generation_config.return_dict_in_generate:
        raise ValueError(f"{', '.join(wanted)} need batch size 1 with a DFlash assistant (batched: sequences only).")


def check_cache(cache, drafter: DFlashDraftModel, generation_config: GenerationConfig, batch_size: int) -> None:
    """The target cache must exist and roll back; with several rows it must be a DynamicCache whose sliding
    windows (if any) generation cannot reach, since the holes of rejected drafts would shift a window (a
    window counts slots), or a StaticCache without windows, and the drafter must have no sliding-window
    layers for the same reason."""
    if cache is None:
        raise ValueError("DFlash generation needs a target cache; do not pass use_cache=False.")
    fixed = sorted({type(layer).__name__ for layer in cache.layers if not getattr(layer, "is_croppable", True)})
    if fixed:
        raise ValueError(
            f"DFlash rolls rejected drafts back out of the target cache, and this cache's {', '.join(fixed)} layers "
            f"cannot be rolled back in Transformers {transformers.__version__} (static layers can from 5.24 on): "
            "drop cache_implementation / the cache argument for the default dynamic cache, or upgrade Transformers."
        )
    if batch_size == 1:
        return
    static = isinstance(cache, StaticCache) and all(type(layer) is StaticLayer for layer in cache.layers)
    if not isinstance(cache, DynamicCache) and not static:
        raise ValueError(
            f"Batched DFlash needs a DynamicCache or a StaticCache of full-attention layers for the target, got "
            f"{type(cache).__name__} ({', '.join(sorted({type(layer).__name__ for layer in cache.layers}))})."
        )
    reachable = 2 * generation_config.max_length + drafter.config.block_size
    for layer in cache.layers:
        window = getattr(layer, "sliding_window", None)
        if layer.is_sliding and window is not None and window <= reachable:
            raise ValueError(
                f"Batched DFlash does not support a target sliding window ({window} tokens) that generation can "
                f"reach (up to {reachable} cache slots); generate one prompt at a time."
            )
    if "sliding_attention" in drafter.config.layer_types:
        raise ValueError(
            "Batched DFlash does not support drafters with sliding-window layers; pass one prompt at a time."
        )


class DecodingLoop:
    """The state of one `generate` call: each row's committed tokens, the target cache's validity mask, the
    drafter's pending context, statistics and the optional outputs; `run` performs the rounds."""

    def __init__(
        self,
        target: PreTrainedModel,
        drafter: DFlashDraftModel,
        logits_processor,
        stopping_criteria,
        generation_config: GenerationConfig,
        streamer=None,
    ):
        self.target, self.drafter = target, drafter
        self.logits_processor, self.stopping_criteria = logits_processor, stopping_criteria
        self.generation_config, self.streamer = generation_config, streamer
        self.do_sample = bool(generation_config.do_sample)
        self.block = BlockDrafter(drafter, target)
        self.layer_ids = list(drafter.config.target_layer_ids)
        # The drafter needs a few layers' hidden states; a caller asking for all of them gets all of them.
        wants_all = bool(generation_config.output_hidden_states)
        self.hidden_request = {"output_hidden_states": True if wants_all else [i + 1 for i in self.layer_ids]}
        self.stats = AcceptanceStats(block_size=drafter.config.block_size)
        want_dict = generation_config.return_dict_in_generate
        self.scores = () if want_dict and generation_config.output_scores else None
        self.raw_logits = () if want_dict and generation_config.output_logits else None
        self.hidden_states = () if want_dict and wants_all else None
        # With an EOS criterion plain `generate` pads finished rows; without one they keep decoding.
        self.pad_finished = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
        pad = generation_config._pad_token_tensor
        self.pad = int(pad) if pad is not None else 0
        self.cap = generation_config.max_length  # without EOS padding: the common final length once all stopped

    def run(self, input_ids: torch.LongTensor, cache_key: str, model_kwargs: dict) -> torch.LongTensor:
        """Decode the left-padded prompts (B, P); returns the sequences (B, L) as plain `generate` does."""
        batch, prompt_length = input_ids.shape
        self.batch_size, self.cache_key, self.cache = batch, cache_key, model_kwargs[cache_key]
        self.sequences = input_ids.new_full((batch, self.generation_config.max_length), self.pad)
        self.sequences[:, :prompt_length] = input_ids  # row b's tokens are sequences[b, :lengths[b]]
        self.lengths = [prompt_length] * batch
        self.stop_lengths: dict[int, int] = {}  # row -> length at which a stopping criterion was met
        self.rows = list(range(batch))  # original row of each active entry
        hybrid = self.generation_config.prompt_lookup_num_tokens is not None
        self.compiled = compiled_verification(self.target, self.generation_config, model_kwargs)
        # A static cache keeps its batch (and a compiled graph its shapes): rows that finish stay in it, idle.
        static = self.cache.is_compileable
        self.cache_rows = torch.arange(batch, device=input_ids.device) if static else None
        self.capacity = cache_capacity(self.cache) if static else None  # a static cache's slots
        fixed_width = self.compiled is not None  # compiled rounds verify one width: the policies weigh drafting only
        # Sampling with hybrid drafting chooses one branch before verification: the block stays a chain there.
        one_branch = hybrid and bool(self.generation_config.do_sample)
        self.trees = None if one_branch else tree_drafting(self.drafter, self.target, fixed_width)
        if self.trees is not None:
            max_nodes, max_length = self.trees.max_nodes, self.generation_config.max_length
            if batch > 1:  # one tree per row would need a mask per row: larger batches draft chains
                warnings.warn(
                    f"drafter.draft_tree serves batch size 1; this batch of {batch} drafts chains.", stacklevel=2
                )
                self.trees = None
            elif not verifies_trees(self.target, self.cache, max_length, max_nodes):
                warnings.warn(
                    "This target cannot verify a draft tree in one forward (attention other than eager/SDPA, "
                    "a cache other than DynamicCache/StaticCache, a sliding window generation can reach, or a "
                    f"static cache without {max_nodes} slots beyond max_length): drafting chains.",
                    stacklevel=2,
                )
                self.trees = None
        self.controller = None
        if not hybrid:
            self.controller = block_size_controller(self.drafter, self.target, batch, fixed_verification=fixed_width)
        self.round_width = self.verification_width(hybrid, one_branch)
        self.hybrid = None
        if hybrid:
            width = self.round_width if fixed_width else None
            self.hybrid = HybridDrafting(self.drafter, self.target, self.generation_config, self.cache, width)
        # Compiled rounds that may verify a tree pass every round as one (a chain is a tree): one graph, one mask.
        self.tree_rounds = fixed_width and (self.trees is not None or (hybrid and not one_branch))
        self.target_mask = input_ids.new_zeros(batch, 0)  # (B, T) validity of the target cache's slots
        self.context, self.context_mask = None, None  # target features the drafter has not read yet

        # Round 0 is the prefill: it reads the whole prompt (and, hybrid, may verify n-gram drafts).
        unread = input_ids  # (B, u) committed tokens the target has not read
        unread_mask = model_kwargs.get("attention_mask")
        if unread_mask is None:
            unread_mask = input_ids.new_ones(batch, prompt_length)
        prefill = True
        while True:
            prefixes = [self.sequences[row, : self.lengths[row]] for row in self.rows]
            planned = self.draft(prefixes, prefill)
            drafts, tree = planned.drafts, planned.tree
            counts_as_round = not prefill or drafts.tokens.shape[1] > 0
            if counts_as_round:
                self.stats.block_sizes.append(planned.block_length)
                self.stats.first_round_in_prefill |= prefill
            outputs = self.verify(unread, unread_mask, drafts, tree, prefill, model_kwargs)
            verdict = self.accept(prefixes, drafts, tree, outputs)
            committed = self.commit(verdict, counts_as_round)
            if self.controller is not None and counts_as_round:
                self.controller.observe(self.rows, planned.slots, verdict.num_accepted)
            if self.trees is not None and counts_as_round and self.hybrid is None:
                self.stats.tree_sizes.append(tree.num_nodes if tree is not None else 1)  # 1: no drafter pass
                if tree is not None:
                    self.trees.observe(int(verdict.num_accepted[0]))
            if self.hybrid is not None and counts_as_round:
                start = self.lengths[0] - int(committed[0])
                self.hybrid.observe(self.sequences[0, start : self.lengths[0]], self.stats)
                if self.trees is not None and planned.slots:  # calibrated by the drafts the block tree won
                    self.trees.observe(self.stats.block_tokens[-1])
            if self.batch_size == 1:
                self.record_outputs(int(committed[0]), verdict, prefill)
            self.rollback(committed, unread_mask, drafts.tokens.shape[1], tree, verdict)
            if not self.prune():
                break
            unread = torch.stack([self.sequences[row, self.lengths[row] - 1] for row in self.rows])[:, None]
            unread_mask = unread.new_ones(unread.shape)
            prefill = False
        if self.streamer is not None:
            self.streamer.end()
        width = max(min(length, self.cap) for length in self.lengths)
        return self.sequences[:, :width]

    def verification_width(self, hybrid: bool, one_branch: bool) -> int:
        """The most tokens a round after the prefill verifies (batch 1: the bonus and its drafts): a fixed
        block k, else the trained block B; a drafter tree's node budget; hybrid: the block's nodes + the
        n-gram drafts (sampling: whichever branch is longer). Compiled rounds are padded to this width."""
        block = self.controller.block_size if isinstance(self.controller, FixedBlockSize) else None
        nodes = self.trees.max_nodes if self.trees is not None else (block or self.drafter.config.block_size)
        if not hybrid:
            return nodes
        ngram = self.generation_config.prompt_lookup_num_tokens
        return max(nodes, 1 + ngram) if one_branch else nodes + ngram

    # --- the steps of a round ---

    def draft(self, prefixes: list[torch.LongTensor], prefill: bool) -> RoundDraft:
        """The round's drafts. The prefill drafts no block (the drafter needs the prompt's features first).
        A block of k tokens drafts k - 1 tokens for every row, never past the longest row's limit; a drafter
        tree (batch 1) holds the most probable continuations of those k - 1 slots."""
        ngram = None
        if self.hybrid is not None:
            block_length, ngram = self.hybrid.plan(prefixes[0], block_allowed=not prefill)
        else:
            block_length = 1 if prefill else self.controller.choose(self.rows)
        num_drafts = max(0, min(block_length - 1, max(self.cap - self.lengths[row] - 1 for row in self.rows)))
        bonus = torch.stack([prefix[-1] for prefix in prefixes])
        drafts, block_tree = Drafts(bonus.new_empty(len(self.rows), 0)), None
        if num_drafts:
            hidden = self.block.draft_hidden(bonus, self.context, self.context_mask, block_length)[:, :num_drafts]
            self.context = None  # the drafter has read it
            if self.trees is not None:
                logits, token_ids = self.block.tree_logits(hidden, self.logits_processor, 1, self.rows, prefixes)
                choosing = self.trees.choosing_size
                block_tree = self.trees.build(int(bonus[0]), logits[0], token_ids)
                if choosing:  # a one-size tree chose its size: the round width follows
                    remember_compiled_size(self.drafter, self.trees)
                    self.round_width = self.verification_width(self.hybrid is not None, one_branch=False)
                    if self.hybrid is not None and self.compiled is not None:
                        self.hybrid.budget.verify_at(self.round_width)
                drafts = Drafts(block_tree.tokens[None, 1:])
                if ngram is None:
                    return RoundDraft(drafts, block_tree, block_length, num_drafts)
            else:
                drafts = self.block.draft(
                    hidden, self.do_sample, self.logits_processor, self.batch_size, self.rows, prefixes
                )
        if ngram is None or (prefill and not len(ngram)):
            return RoundDraft(drafts, None, block_length, num_drafts)
        drafts = self.hybrid.candidates(int(bonus[0]), drafts, ngram, block_tree)
        tree = None if self.hybrid.tree.is_chain else self.hybrid.tree
        return RoundDraft(drafts, tree, block_length, num_drafts)

    def verify(self, unread, unread_mask, drafts: Drafts, tree: DraftTree | None, prefill: bool, model_kwargs):
        """ONE target forward over [unread (B, u), drafts (B, d)] with the hidden states the drafter needs.

        The prefill goes through `prepare_inputs_for_generation` with `generate`'s own model kwargs, as plain
        decoding's first step does; later rounds give each row its positions (its number of valid slots)
        and a 2D mask of the valid slots. A tree (batch 1) sees its context and its ancestors only. Compiled
        rounds verify exactly `self.round_width` tokens: fewer are padded (`pad_round`; a tree's padding
        nodes hang below its last node), and where trees may come every round goes as a tree (a chain is one),
        so one graph serves them all; a round whose padded width would not fit the static cache runs eager
        instead of compiling a new shape, as do the rounds before a one-size tree has chosen its size."""
        tokens = torch.cat([unread, drafts.tokens], 1)
        num_drafts = drafts.tokens.shape[1]
        forward, padding = self.target, 0
        parents = tree.parents if tree is not None else None
        if not prefill and self.cache_rows is not None:
            self.make_room(tokens.shape[1], self.round_width)
        # Until a one-size tree ("auto" under compile) has chosen its size, rounds run eager.
        if not prefill and self.compiled is not None and not (self.trees is not None and self.trees.choosing_size):
            padding = self.round_width - tokens.shape[1]
            if padding >= 0 and self.target_mask.shape[1] + self.round_width <= self.capacity:
                forward = self.compiled
                tokens = pad_round(tokens, padding) if padding else tokens
                if self.tree_rounds:
                    parents = padded_parents(parents or chain_parents(tokens.shape[1] - padding), padding)
            else:  # the padded round would not fit the cache (the last round): eager, no new graph
                padding = 0
        if prefill:
            kwargs = dict(model_kwargs)
            if kwargs.get("attention_mask") is not None:
                kwargs["attention_mask"] = torch.cat([unread_mask, unread_mask.new_ones(drafts.tokens.shape)], 1)
            if kwargs.get("position_ids") is not None and num_drafts:
                last = kwargs["position_ids"][:, -1:]
                kwargs["position_ids"] = torch.cat(
                    [kwargs["position_ids"], last + 1 + torch.arange(num_drafts, device=last.device)], 1
                )
            model_inputs = self.target.prepare_inputs_for_generation(tokens, is_first_iteration=True, **kwargs)
        else:
            fresh = unread_mask.new_ones(tokens.shape)  # after the prefill every row's unread token is valid
            mask = torch.cat([self.target_mask, fresh], 1)
            positions = self.target_mask.sum(1, keepdim=True) + fresh.cumsum(1) - 1
            if self.cache_rows is not None:  # idle rows (finished) read their own slots, and are ignored
                tokens, mask = self.all_cache_rows(tokens, self.pad), self.all_cache_rows(mask, 1)
                positions = self.all_cache_rows(positions, 0)
            model_inputs = self.target.prepare_inputs_for_generation(
                tokens,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{self.cache_key: self.cache},
            )
        if "logits_to_keep" in model_inputs:
            model_inputs["logits_to_keep"] = num_drafts + 1 + padding
        model_inputs |= self.hidden_request
        if parents is not None:  # each node sees the context and its ancestors, at position root + depth
            model_inputs |= tree_inputs(self.target, model_inputs, parents, self.target_mask.shape[1], self.capacity)
        outputs = forward(**model_inputs)
        if padding:
            self.cache.crop(-padding)
            outputs = drop_padding(outputs, padding)
        if self.cache_rows is not None and len(self.cache_rows) < outputs.logits.shape[0]:
            outputs = select_rows(outputs, self.cache_rows)
        return outputs

    def all_cache_rows(self, values: torch.Tensor, fill: int) -> torch.Tensor:
        """values (R, n) of the active rows laid out over all the static cache's rows (B, n), `fill` elsewhere."""
        if len(self.cache_rows) == self.batch_size:
            return values
        full = values.new_full((self.batch_size, values.shape[1]), fill)
        full[self.cache_rows] = values
        return full

    def make_room(self, needed: int, wanted: int) -> None:
        """Compact a static cache's holes (rejected drafts of some rows) when `wanted` more slots (a padded
        compiled round) would not fit; ValueError if even `needed` (the round itself) does not fit then."""
        if self.target_mask.shape[1] + max(needed, wanted) <= self.capacity:
            return
        valid = self.all_cache_rows(self.target_mask, 0)  # idle rows keep nothing
        self.target_mask = compact_cache(self.cache, valid)[self.cache_rows]
        if self.target_mask.shape[1] + needed > self.capacity:
            raise ValueError(
                f"The static cache ({self.capacity} slots) cannot hold a round of {needed} tokens after "
                f"{self.target_mask.shape[1]} kept slots: pass max_cache_len >= max_length + {wanted}."
            )

    def accept(self, prefixes, drafts: Drafts, tree: DraftTree | None, outputs) -> Verdict:
        """The tokens each row commits, as the target decides. A tree's outputs come laid out along its
        accepted path, as if it had been a chain."""
        num_drafts = drafts.tokens.shape[1]
        raw_logits = outputs.logits[:, -num_drafts - 1 :].float()
        hidden = outputs.hidden_states
        if tree is not None:  # the longest accepted path through the tree (batch 1)
            processed = process_tree_logits(self.logits_processor, prefixes[0][None], tree, raw_logits)
            if self.do_sample:
                path, last = sampled_tree_path(tree, processed[0].softmax(-1))
                new_tokens = torch.cat([tree.tokens[path[1:]].to(last.device), last])[None]
            else:
                path = greedy_tree_path(tree, greedy_tokens(processed[0]))
                new_tokens = greedy_tokens(processed[:, path])
            raw_logits, processed = raw_logits[:, path], processed[:, path]
            hidden = tuple(None if h is None else h[:, path] for h in hidden)
            return Verdict(new_tokens, torch.tensor([len(path) - 1]), processed, raw_logits, hidden, path)
        processed = process_rows(self.logits_processor, self.batch_size, self.rows, prefixes, drafts.tokens, raw_logits)
        if self.do_sample:
            new_tokens, num_accepted = sample_rows(drafts.tokens, drafts.scores, processed.softmax(-1))
        else:
            new_tokens = greedy_tokens(processed)  # (B, d+1): the target's token after each prefix
            num_accepted = accepted_lengths(drafts.tokens, new_tokens)
        return Verdict(new_tokens, num_accepted, processed, raw_logits, hidden)

    def commit(self, verdict: Verdict, counts_as_round: bool) -> torch.LongTensor:
        """Write each row's new tokens, one by one up to its first stop, as plain decoding would; returns
        the tokens each row committed this round (B,) (rows without EOS padding keep decoding after their
        stop until every row has stopped, as in plain `generate`; the output then ends at the last stop)."""
        starts = list(self.lengths)
        for i, row in enumerate(self.rows):
            start = self.lengths[row]
            tokens = verdict.new_tokens[i, : int(verdict.num_accepted[i]) + 1][: self.cap - start]
            end = start + len(tokens)
            self.sequences[row, start:end] = tokens
            if row not in self.stop_lengths:
                copies = row_copies(self.sequences[row, :end], self.batch_size)
                kept, stopped = count_until_stop(self.stopping_criteria, copies, start, self.scores, row=row)
                if stopped:
                    self.stop_lengths[row] = start + kept
                    if self.pad_finished:
                        self.sequences[row, start + kept : end] = self.pad
                        end = start + kept
            self.lengths[row] = end
        if not self.pad_finished and len(self.stop_lengths) == self.batch_size:
            self.cap = max(self.stop_lengths.values())  # plain decoding stops when the last row does
        committed = [min(self.lengths[row], self.cap) - starts[row] for row in self.rows]
        if counts_as_round:
            self.stats.acceptance_lengths.extend(committed)
        if self.streamer is not None:
            self.streamer.put(self.sequences[:1, starts[0] : starts[0] + committed[0]].cpu())
        return torch.tensor(committed)

    def record_outputs(self, kept: int, verdict: Verdict, prefill: bool) -> None:
        """Scores, logits and hidden states of the committed tokens, one entry per token (batch 1)."""
        if self.scores is not None:
            self.scores += tuple(verdict.processed[:, i] for i in range(kept))
        if self.raw_logits is not None:
            self.raw_logits += tuple(verdict.raw_logits[:, i] for i in range(kept))
        if self.hidden_states is not None:
            prompt_length = self.lengths[0] - kept
            self.hidden_states += split_hidden_states(verdict.hidden_states, prompt_length, kept, prefill)

    def rollback(self, committed, unread_mask, num_drafts: int, tree: DraftTree | None, verdict: Verdict) -> None:
        """Keep the cache slots of the unread tokens and of the committed drafts, drop or mask the rest, and
        hand the target features of the kept slots to the drafter's pending context."""
        valid_drafts = (committed - 1).clamp_min(0).to(unread_mask.device)  # the last committed token is unread
        if tree is not None:
            kept = int(committed[0])
            keep_tree_path(self.cache, tree.num_nodes, verdict.path[:kept])
            slot_valid = unread_mask.new_ones(1, kept)
        else:
            slots = torch.arange(num_drafts, device=unread_mask.device)
            slot_valid = torch.cat([unread_mask, (slots < valid_drafts[:, None]).to(unread_mask.dtype)], 1)
            used = unread_mask.shape[1] + int(valid_drafts.max())  # later slots are rejected in every row
            if used < slot_valid.shape[1]:
                self.cache.crop(used - slot_valid.shape[1])
            slot_valid = slot_valid[:, :used]
        self.target_mask = torch.cat([self.target_mask, slot_valid], 1)
        features = target_layer_features(verdict.hidden_states, self.layer_ids, slot_valid.shape[1])
        if self.context is None:
            self.context, self.context_mask = features, slot_valid
        else:
            self.context = torch.cat([self.context, features], 1)
            self.context_mask = torch.cat([self.context_mask, slot_valid], 1)

    def prune(self) -> bool:
        """Drop the rows that finished (EOS padding, or the final length); False when none is left."""
        finished = [
            (self.pad_finished and row in self.stop_lengths) or self.lengths[row] >= self.cap for row in self.rows
        ]
        keep = [i for i, done in enumerate(finished) if not done]
        if not keep:
            return False
        index = None
        if len(keep) < len(self.rows):
            index = torch.tensor(keep, device=self.target_mask.device)
            if self.cache_rows is None:
                self.cache.batch_select_indices(index)
            else:  # a static cache keeps every row (`verify` feeds the finished ones idle tokens)
                self.cache_rows = self.cache_rows[index]
            self.target_mask = self.target_mask[index]
            self.context, self.context_mask = self.context[index], self.context_mask[index]
            self.rows = [self.rows[i] for i in keep]
        self.block.prune(index)
        if self.cache_rows is None and needs_compaction(self.target_mask):  # static caches: `make_room`
            self.target_mask = compact_cache(self.cache, self.target_mask)
        return True


def compiled_verification(target: PreTrainedModel, generation_config: GenerationConfig, model_kwargs: dict):
    """The target's compiled forward for the rounds after the prefill, exactly where Transformers' own decoding
    compiles its step (`_valid_auto_compile_criteria`: a compileable cache such as
    `cache_implementation="static"`, on an accelerator or with `compile_config._compile_all_devices`, and
    `disable_compile` unset); None (eager) otherwise. The prefill stays eager, as in Transformers."""
    if not target._valid_auto_compile_criteria(model_kwargs, generation_config):
        return None
    import torch._inductor.config as inductor_config

    if inductor_config.freezing:
        raise ValueError(
            "torch._inductor.config.freezing = True cannot compile DFlash verification over a static cache: freezing "
            "folds the cache's buffers into the graph (torch 2.13), so a later generate() call's new cache is never "
            "read and drafts are verified against stale keys. Set torch._inductor.config.freezing = False, or drop "
            "compile_config to verify eagerly."
        )
    return target.get_compiled_call(generation_config.compile_config)


def cache_capacity(cache) -> int:
    """The slots a static cache holds (its smallest layer's; layers without a maximum are not counted)."""
    return min(length for layer in cache.layers if (length := layer.get_max_length()) > 0)


def pad_round(tokens: torch.LongTensor, padding: int) -> torch.LongTensor:
    """tokens (B, n) followed by `padding` copies of their last column (B, n + padding): a compiled round keeps
    the block's shape when fewer drafts fit. The copies come after every real token, so causal attention
    keeps them from changing any real token's output; their outputs and cache slots are dropped."""
    return torch.cat([tokens, tokens[:, -1:].expand(-1, padding)], 1)


def select_rows(outputs, rows: torch.LongTensor):
    """`outputs` of the rows `rows` only (logits and hidden states)."""
    outputs.logits = outputs.logits[rows]
    if outputs.hidden_states is not None:
        outputs.hidden_states = tuple(None if h is None else h[rows] for h in outputs.hidden_states)
    return outputs


def drop_padding(outputs, padding: int):
    """`outputs` of a padded round without its last `padding` positions (logits and hidden states)."""
    outputs.logits = outputs.logits[:, :-padding]
    if outputs.hidden_states is not None:
        outputs.hidden_states = tuple(None if h is None else h[:, :-padding] for h in outputs.hidden_states)
    return outputs


def tree_inputs(model, model_inputs: dict, parents: tuple[int, ...], past: int, key_slots: int | None = None) -> dict:
    """The 4D attention mask and per-node position ids of a tree forward over N nodes (`parents`) after `past`
    cached slots, over `key_slots` keys (a static cache's length; default past + N). The root (the bonus
    token) sits where a chain's first token would (the position the chain inputs give it); node i at
    root + depth(i). Context slots masked out by the 2D mask stay masked."""
    device = model_inputs["input_ids"].device
    bias = tree_attention_bias(parents, past, model.dtype, device, key_slots)
    mask = model_inputs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask[0, :past].all()):
        visible = mask[0, :past].bool().to(device)
        bias[..., :past] = bias[..., :past].masked_fill(~visible, torch.finfo(model.dtype).min)
    root = int(model_inputs["position_ids"][0, -len(parents)])
    return {"attention_mask": bias, "position_ids": (root + tree_depths(parents)).to(device)[None]}


def split_hidden_states(layer_states: tuple, prompt_length: int, kept: int, prefill: bool) -> tuple:
    """Per-token hidden states as plain decoding returns them: the prefill step covers the prompt and
    the first token; every later token gets its own (B, 1, H) slice per layer (after a prefill that
    verified drafts: those of the accepted drafts, which follow the prompt)."""
    if prefill:
        first = (tuple(h[:, :prompt_length] for h in layer_states),)
        return first + tuple(
            tuple(h[:, t : t + 1] for h in layer_states) for t in range(prompt_length, prompt_length + kept - 1)
        )
    return tuple(tuple(h[:, t : t + 1] for h in layer_states) for t in range(kept))
