"""ONE target forward per round over [unread tokens, drafts], on the execution path the call runs.

`Verifier` runs the target eagerly: the prefill through `prepare_inputs_for_generation` with `generate`'s
own model kwargs, as plain decoding's first step does; later rounds give each row its positions (its number
of valid slots) and a 2D mask of the valid slots; a tree (batch 1) sees its context and its ancestors only
(a 4D mask, positions by depth). `CompiledVerifier` runs the rounds after the prefill through the target's
compiled forward at ONE width per call (the strategy's): fewer tokens are padded (`pad_round`; a tree's
padding nodes hang below its last node), and where trees may come every round goes as a tree (a chain is
one), so one graph serves the call; a round whose padded width would not fit the static cache runs eager
instead of compiling a new shape, as do the rounds before a one-size tree has chosen its size. Where the
strategy may choose a plain step (the bonus token alone: drafting does not pay for this prompt on this machine),
that step runs its own width-1 graph, as plain decoding's step, not a round padded to the width. Both graphs
are compiled after the prefill, before the first round (`warm_graphs`): no round whose time the adaptive
policies learn from holds a compilation.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, PreTrainedModel

from ..drafting.draft_tree import chain_parents, padded_parents, tree_depths
from ..drafting.proposal import Proposal
from ..drafting.strategies.base import DraftStrategy
from ..target_slots import TargetSlots
from .tree_verification import tree_attention_bias


class Verifier:
    """Eager verification of the rounds of one `generate` call."""

    def __init__(self, target: PreTrainedModel, slots: TargetSlots, strategy: DraftStrategy, hidden_request: dict):
        self.target, self.slots, self.strategy = target, slots, strategy
        self.hidden_request = hidden_request  # the layers the drafter reads (all of them when the caller asks)

    def verify(self, unread, unread_mask, proposal: Proposal, prefill: bool, model_kwargs: dict):
        """The target's outputs (logits, hidden states) over [unread (R, u), drafts (R, d)] for the active rows."""
        drafts = proposal.drafts.tokens
        tokens = torch.cat([unread, drafts], 1)
        parents = proposal.tree.parents if proposal.tree is not None else None
        if not prefill and self.slots.capacity is not None:
            self.slots.make_room(tokens.shape[1], self.strategy.width())
        if prefill:
            forward, padding = self.target, 0
            model_inputs = self.prefill_inputs(tokens, unread_mask, drafts.shape[1], model_kwargs)
            model_inputs = self.with_round_extras(model_inputs, parents, drafts.shape[1] + 1)
        else:
            forward, tokens, parents, padding = self.shape_round(tokens, parents)
            model_inputs = self.round_inputs(tokens, parents, drafts.shape[1] + 1 + padding)
        outputs = forward(**model_inputs)
        if padding:
            self.slots.cache.crop(-padding)
            outputs = drop_padding(outputs, padding)
        outputs.logits = self.slots.active_rows(outputs.logits)
        if outputs.hidden_states is not None:
            outputs.hidden_states = tuple(
                None if h is None else self.slots.active_rows(h) for h in outputs.hidden_states
            )
        return outputs

    def round_inputs(self, tokens: torch.LongTensor, parents, logits: int) -> dict:
        """The target's inputs for a round after the prefill over `tokens` (R, n): each row's positions and valid
        slots, a tree's mask when `parents` is given, the hidden states the drafter reads, `logits` positions."""
        tokens, mask, positions = self.slots.round_inputs(tokens)
        model_inputs = self.target.prepare_inputs_for_generation(
            tokens,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self.slots.cache_key: self.slots.cache},
        )
        return self.with_round_extras(model_inputs, parents, logits)

    def with_round_extras(self, model_inputs: dict, parents, logits: int) -> dict:
        if "logits_to_keep" in model_inputs:
            model_inputs["logits_to_keep"] = logits
        model_inputs |= self.hidden_request
        if parents is not None:  # each node sees the context and its ancestors, at position root + depth
            model_inputs |= tree_inputs(self.target, model_inputs, parents, self.slots.length, self.slots.capacity)
        return model_inputs

    def shape_round(self, tokens: torch.LongTensor, parents):
        """(forward, tokens, parents, padding) of a round after the prefill: eager, as it is."""
        return self.target, tokens, parents, 0

    def warm_graphs(self, rows: int) -> None:
        """Nothing to compile (eager rounds)."""

    def prefill_inputs(self, tokens, unread_mask, num_drafts: int, model_kwargs: dict) -> dict:
        """The first forward's inputs as `generate` prepares them, extended over the drafts it verifies (hybrid
        drafting's n-gram drafts)."""
        kwargs = dict(model_kwargs)
        if kwargs.get("attention_mask") is not None:
            kwargs["attention_mask"] = torch.cat([unread_mask, unread_mask.new_ones(tokens.shape[0], num_drafts)], 1)
        if kwargs.get("position_ids") is not None and num_drafts:
            last = kwargs["position_ids"][:, -1:]
            kwargs["position_ids"] = torch.cat(
                [kwargs["position_ids"], last + 1 + torch.arange(num_drafts, device=last.device)], 1
            )
        return self.target.prepare_inputs_for_generation(tokens, is_first_iteration=True, **kwargs)


class CompiledVerifier(Verifier):
    """Rounds after the prefill through `compiled` (the target's compiled forward) at the strategy's width."""

    def __init__(self, target, slots: TargetSlots, strategy: DraftStrategy, hidden_request: dict, compiled):
        super().__init__(target, slots, strategy, hidden_request)
        self.compiled = compiled
        self.plain_steps = strategy.takes_plain_steps()

    def warm_graphs(self, rows: int) -> None:
        """Compile the graphs this call's rounds will run, after the prefill and before the first round is timed:
        the round padded to the strategy's width (once it is settled) and, where the strategy may choose plain
        steps, the width-1 step. Each is one forward over placeholder tokens (`rows` (R) active rows) in the slots
        after the prefill's, cropped back (the first round overwrites them; the outputs are dropped), once per
        compiled forward and input shape (`warmed_shapes`)."""
        widths = ([1] if self.plain_steps else []) + ([self.strategy.width()] if self.strategy.width_settled() else [])
        warmed = warmed_shapes(self.compiled)
        for width in dict.fromkeys(widths):
            trees = self.strategy.sends_trees and width > 1
            key = (width, self.slots.batch_size, self.slots.capacity, trees, repr(self.hidden_request))
            if key in warmed or not self.slots.fits(width):
                continue
            tokens = torch.full((rows, width), self.slots.pad, dtype=torch.long, device=self.slots.mask.device)
            parents = padded_parents(chain_parents(1), width - 1) if trees else None
            self.compiled(**self.round_inputs(tokens, parents, width))
            self.slots.cache.crop(-width)
            warmed.add(key)

    def shape_round(self, tokens: torch.LongTensor, parents):
        if self.plain_steps and tokens.shape[1] == 1:  # a plain step: its own graph, as plain decoding's
            return self.compiled, tokens, None, 0
        width = self.strategy.width()
        padding = width - tokens.shape[1]
        # Until a one-size tree ("auto" under compile) has chosen its size, and where the padded round would not
        # fit the cache (the last round), rounds run eager: no new graph.
        if not self.strategy.width_settled() or padding < 0 or not self.slots.fits(width):
            return self.target, tokens, parents, 0
        if padding:
            tokens = pad_round(tokens, padding)
        if self.strategy.sends_trees:
            parents = padded_parents(parents or chain_parents(tokens.shape[1] - padding), padding)
        return self.compiled, tokens, parents, padding


def warmed_shapes(compiled) -> set:
    """The input shapes (`CompiledVerifier.warm_graphs`' keys) `compiled` has already run, kept on it."""
    if not hasattr(compiled, "hf_dflash_warmed_shapes"):
        compiled.hf_dflash_warmed_shapes = set()
    return compiled.hf_dflash_warmed_shapes


def verifier(target, slots: TargetSlots, strategy: DraftStrategy, hidden_request: dict, compiled) -> Verifier:
    """The verifier of the call's execution path: compiled when `compiled` (the target's compiled forward)."""
    if compiled is None:
        return Verifier(target, slots, strategy, hidden_request)
    return CompiledVerifier(target, slots, strategy, hidden_request, compiled)


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


def pad_round(tokens: torch.LongTensor, padding: int) -> torch.LongTensor:
    """tokens (B, n) followed by `padding` copies of their last column (B, n + padding): a compiled round keeps
    the block's shape when fewer drafts fit. The copies come after every real token, so causal attention
    keeps them from changing any real token's output; their outputs and cache slots are dropped."""
    return torch.cat([tokens, tokens[:, -1:].expand(-1, padding)], 1)


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
