"""Train/serve consistency: predict from the packed training forward the τ that `generate` serves.

The trainer's usual τ estimate averages over anchors drawn uniformly from the replies. Serving does
not visit anchors uniformly: after a round at anchor p that commits τ(p) tokens, the next round's
anchor is p + τ(p), so positions where the drafter is weak are visited more often than they are
sampled. Walking the anchors the way serving does, with τ(p) read off the same packed forward,
predicts the served τ round for round (greedy, fixed block size, same target dtype as the data).

    estimate = served_tau_estimate(drafter, target, samples)
    estimate.uniform_tau, estimate.served_tau   # the trainer's usual figure, and the served prediction

A gap between `served_tau` and what `generate` reports on the same chats means training and serving
disagree: a bug to find (mask, positions, labels, features), not a number to report.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..generation.drafting.draft_tree import accepted_path, best_first_tree, best_first_tree_by
from ..generation.drafting.selector import selector_chain, selector_tree_children
from ..target_features import compute_target_features
from .forward import dflash_training_forward
from .maths import build_blocks

__all__ = [
    "ServedTauEstimate",
    "anchor_taus",
    "reply_spans",
    "served_tau_estimate",
    "served_tree_tau_estimates",
    "walk_served_rounds",
]


def reply_spans(loss_mask: list[int]) -> list[tuple[int, int]]:
    """[(start, end)) of each maximal run of supervised positions (one per assistant reply)."""
    spans, start = [], None
    for position, flag in enumerate(list(loss_mask) + [0]):
        if flag and start is None:
            start = position
        elif not flag and start is not None:
            spans.append((start, position))
            start = None
    return spans


def walk_served_rounds(tau_at: dict[int, int], spans: list[tuple[int, int]]) -> list[int]:
    """τ of each round serving would run: in each reply the first anchor is its first token (the bonus
    token of the prefill), and a round at anchor p is followed by one at p + τ(p), while a next token
    exists in the reply (p + 1 < end). A round commits at most the end - 1 - p tokens the reply has left
    (it ends at its EOS, or at max_new_tokens)."""
    rounds = []
    for start, end in spans:
        position = start
        while position + 1 < end:
            tau = min(tau_at[position], end - 1 - position)
            rounds.append(tau)
            position += tau
    return rounds


def anchor_taus(correct: torch.BoolTensor, block_size: int) -> torch.LongTensor:
    """(A,) τ of the block at each anchor: 1 + the run of correct drafts from slot 1 (correct (A*bs,))."""
    chain = correct.view(-1, block_size)[:, 1:].long().cumprod(-1)
    return 1 + chain.sum(-1)


@dataclass
class ServedTauEstimate:
    """Uniform-anchor and serving-walk τ over the same samples (greedy, block size B)."""

    uniform_tau: float  # mean τ over every anchor of every reply (what uniform sampling estimates)
    served_tau: float  # mean τ over the rounds serving would run
    rounds: list[int] = field(default_factory=list)  # τ of every served round, in order
    per_sample: list[float] = field(default_factory=list)  # served τ per sample
    per_sample_rounds: list[int] = field(default_factory=list)  # served rounds per sample


@torch.no_grad()
def served_tau_estimate(
    drafter,
    target,
    samples: list[dict],
    anchors_per_forward: int = 64,
    max_reply_tokens: int | None = None,
) -> ServedTauEstimate:
    """Estimate the served τ of `drafter` on `samples` (`{"input_ids", "loss_mask"[, "target_hidden_states"]}`).

    One target forward per sample gives the features (or the cached ones are used); the drafter then runs
    the packed training forward with an anchor at EVERY reply position (in chunks of `anchors_per_forward`
    to bound memory), and the greedy drafts (`served_drafts`: argmax, or a DFlash2 drafter's selector walk) are
    compared with the data tokens (the target's own greedy reply). `max_reply_tokens` = N: each reply as
    `generate(max_new_tokens=N)` serves it, its first N tokens (τ over the start of replies, where it is lowest).
    """
    lm_head = target.get_output_embeddings()
    block_size = drafter.config.block_size

    def chain_taus(hidden, blocks):
        drafts = served_drafts(drafter, hidden, lm_head, blocks["block_ids"])  # (1, A*bs)
        correct = (drafts == blocks["labels"]) & (blocks["loss_weights"] > 0)
        return {"chain": anchor_taus(correct[0], block_size)}

    return served_estimates(drafter, target, samples, chain_taus, anchors_per_forward, max_reply_tokens)["chain"]


def served_drafts(drafter, hidden: torch.Tensor, lm_head, block_ids: torch.LongTensor) -> torch.LongTensor:
    """(1, A*bs) the greedy drafts serving makes from the packed forward's outputs hidden (1, A*bs, H) of blocks
    block_ids (1, A*bs): each slot's argmax, or a DFlash2 drafter's selector walk from each block's anchor
    (slot 0 of each block then holds the anchor: it is never scored)."""
    if drafter.candidate_selector is None:
        return drafter.greedy_draft_tokens(hidden, lm_head)
    block_size = drafter.config.block_size
    blocks = hidden.view(-1, block_size, hidden.shape[-1])  # (A, bs, H)
    anchors = block_ids.view(-1, block_size)[:, 0]
    walk = selector_chain(drafter, blocks[:, 1:], lm_head, anchors).tokens  # (A, bs - 1)
    return torch.cat([anchors[:, None], walk], 1).view(1, -1)


@torch.no_grad()
def served_tree_tau_estimates(
    drafter, target, samples: list[dict], budgets: list[int], top_k: int = 16, anchors_per_forward: int = 64
) -> dict[int, ServedTauEstimate]:
    """`served_tau_estimate` for draft trees: τ(p) is 1 + the depth of the longest prefix of the data's
    continuation held by the drafter's best-first tree of N nodes
    (`generation.drafting.draft_tree.best_first_tree`: the N - 1 most probable continuations, the `top_k` best
    tokens per slot; a DFlash2 drafter's selector trees, its own top-K), for each N in `budgets`, from one tree
    of the largest budget (a smaller tree is its first N nodes)."""
    lm_head = target.get_output_embeddings()
    block_size, largest = drafter.config.block_size, max(budgets)
    token_ids = drafter.draft_token_ids

    def tree_taus(hidden, blocks):
        logits = drafter.draft_logits(hidden, lm_head, full_vocab=False).float()  # (1, A*bs, V')
        log_probs, ranked = logits.log_softmax(-1).topk(min(top_k, logits.shape[-1]), dim=-1)
        if token_ids is not None:
            ranked = token_ids.to(ranked.device)[ranked]
        slots = lambda t: t.view(-1, block_size, *t.shape[2:])[:, 1:]  # noqa: E731  (A, L, ...) draft slots
        labels, supervised = slots(blocks["labels"]), slots(blocks["loss_weights"] > 0)
        log_probs, ranked = slots(log_probs), slots(ranked)
        taus = {budget: [] for budget in budgets}
        anchors = blocks["block_ids"].view(-1, block_size)[:, 0].tolist()
        for a in range(labels.shape[0]):
            if drafter.candidate_selector is None:
                tree, _ = best_first_tree(0, ranked[a], log_probs[a], largest)
            else:  # DFlash2: each node's children ranked by the selector given the node's token
                children = selector_tree_children(drafter, slots(hidden)[a], slots(logits)[a], token_ids)
                tree, _ = best_first_tree_by(anchors[a], block_size - 1, children, largest)
            reply = labels[a][supervised[a].long().cumprod(0).bool()].tolist()  # up to the first unsupervised
            path = accepted_path(tree, reply)[1:]
            for budget in budgets:  # nodes along a path are numbered increasingly: count those below N
                taus[budget].append(1 + sum(node < budget for node in path))
        return {budget: torch.tensor(values) for budget, values in taus.items()}

    return served_estimates(drafter, target, samples, tree_taus, anchors_per_forward)


def served_estimates(
    drafter, target, samples: list[dict], score, anchors_per_forward: int, max_reply_tokens: int | None = None
) -> dict:
    """The served-walk and uniform τ of every scoring `score(hidden, blocks) -> {key: (A,) τ per anchor}`
    gives, over `samples`: one packed training forward with an anchor at every reply position (in chunks), or
    at the first `max_reply_tokens` - 1 of each reply (the walk then ends each reply there)."""
    if max_reply_tokens is not None and (
        not isinstance(max_reply_tokens, int) or isinstance(max_reply_tokens, bool) or max_reply_tokens < 2
    ):
        raise ValueError(
            f"max_reply_tokens={max_reply_tokens!r}: an int >= 2 (tokens per reply), or None for whole replies."
        )
    config = drafter.config
    block_size, device = config.block_size, next(drafter.parameters()).device
    embedding = target.get_input_embeddings()
    taus_at: dict = {}  # key -> per sample: {position: τ}
    spans_of: list[list[tuple[int, int]]] = []  # per sample: the replies served, [start, end)
    drafter_was_training = drafter.training
    drafter.eval()
    for sample in samples:
        input_ids = torch.as_tensor(sample["input_ids"], device=device)[None]
        loss_mask = torch.as_tensor(sample["loss_mask"], device=device)[None]
        if "target_hidden_states" in sample:
            features = torch.as_tensor(sample["target_hidden_states"], device=device)[None]
        else:
            features = compute_target_features(target, input_ids, config.target_layer_ids, torch.ones_like(input_ids))
        features = features.to(next(drafter.parameters()).dtype)
        spans = reply_spans(sample["loss_mask"])
        if max_reply_tokens is not None:  # each reply as max_new_tokens cuts it
            spans = [(start, min(end, start + max_reply_tokens)) for start, end in spans]
        spans_of.append(spans)
        # anchors with a next token in their (cut) reply
        candidates = torch.tensor(
            [p for start, end in spans for p in range(start, end - 1)], dtype=torch.long, device=device
        )
        sample_taus: dict = {}
        for chunk in candidates.split(anchors_per_forward):
            anchors = chunk[None]
            valid = torch.ones_like(anchors, dtype=torch.bool)
            blocks = build_blocks(input_ids, loss_mask, anchors, valid, block_size, config.mask_token_id, 1.0)
            batch = {"input_ids": input_ids, "anchor_positions": anchors, "anchor_valid": valid, **blocks}
            hidden = dflash_training_forward(drafter, embedding, batch, features, config)
            for key, taus in score(hidden, blocks).items():
                sample_taus.setdefault(key, {}).update(zip(chunk.tolist(), taus.tolist()))
        for key, tau_at in sample_taus.items():
            taus_at.setdefault(key, []).append(tau_at)
    drafter.train(drafter_was_training)
    estimates = {}
    for key, per_sample_taus in taus_at.items():
        rounds, per_sample, counts, every = [], [], [], []
        for spans, tau_at in zip(spans_of, per_sample_taus):
            every += list(tau_at.values())
            sample_rounds = walk_served_rounds(tau_at, spans)
            rounds += sample_rounds
            per_sample.append(sum(sample_rounds) / len(sample_rounds) if sample_rounds else 0.0)
            counts.append(len(sample_rounds))
        estimates[key] = ServedTauEstimate(
            uniform_tau=sum(every) / len(every) if every else 0.0,
            served_tau=sum(rounds) / len(rounds) if rounds else 0.0,
            rounds=rounds,
            per_sample=per_sample,
            per_sample_rounds=counts,
        )
    return estimates
