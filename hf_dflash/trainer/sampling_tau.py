"""Held-out τ under sampling: what a drafter's blocks are worth when `generate(do_sample=True, temperature=T)` serves
them, read off one target forward and the packed drafter forward (no generation).

At a block slot k the target's next-token distribution p_k (its logits at temperature T, given the chat's tokens
before that position) meets the drafter's q_k (its logits at the same T). How often a draft is accepted depends on how
the loop drafts and verifies:

    "sample"   drafts sampled from q, verified by rejection sampling (Leviathan et al. 2023): a_k = sum_v min(p_k, q_k)
    "argmax"   the drafter's most probable token, verified by drawing the target's token and keeping the draft
               when they agree (any proposal is lossless this way): a_k = p_k(argmax q_k)
    "top-N"    the N most probable tokens as one tree level verified the same way (the target's draw steps to the
               child that holds it): a_k = sum over those N tokens of p_k

A chain's expected τ at an anchor is 1 + sum_k prod_{j<=k} a_j (drafts stop at the reply's end). The estimate walks
the data's own tokens (a sampled chat is the target's sample, so its prefixes are the ones sampling visits; a greedy
chat's are the likeliest ones) and averages over every anchor of every reply. A DFlash2 drafter is scored on its
block pass's per-slot distribution (its selector, which re-ranks each slot given the draft before it, is left out).
"""

from __future__ import annotations

import torch

from ..target_features import compute_target_features_and_logits
from .consistency import reply_spans
from .forward import dflash_training_forward
from .maths import build_blocks

__all__ = [
    "DRAFT_RULES",
    "draft_acceptance",
    "draft_temperature_taus",
    "expected_chain_tau",
    "sampling_tau_estimate",
    "slot_distributions",
    "slot_logits",
]

DRAFT_RULES = ("sample", "argmax", "top-2", "top-4")


def rule_width(rule: str) -> int:
    """The draft tokens a slot holds under `rule`: 0 for "sample" (one draw from q), 1 for "argmax", N for "top-N"."""
    if rule in ("sample", "argmax"):
        return int(rule == "argmax")
    if rule.startswith("top-") and rule[4:].isdigit() and int(rule[4:]) >= 1:
        return int(rule[4:])
    raise ValueError(f"Unknown draft rule {rule!r}: one of {', '.join(DRAFT_RULES)} (or top-N, N >= 1).")


def draft_acceptance(target_probs: torch.Tensor, draft_probs: torch.Tensor, rule: str) -> torch.Tensor:
    """(...,) probability that a slot's draft is accepted under `rule` (see `DRAFT_RULES`), from the target's
    distribution target_probs (..., V) and the drafter's draft_probs (..., V) at the same slots."""
    width = rule_width(rule)
    if width == 0:
        return torch.minimum(target_probs, draft_probs).sum(-1)
    return target_probs.gather(-1, draft_probs.topk(width, dim=-1).indices).sum(-1)


def expected_chain_tau(acceptance: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
    """(A,) expected τ of chains whose slot k (k = 1..L) is accepted with probability acceptance (A, L) once every
    slot before it was; drafted (A, L) marks the slots that hold a draft (a chain stops at the first that does not)."""
    survival = (acceptance * drafted).cumprod(-1)  # (A, L) P(slots 1..k all accepted)
    return 1 + survival.sum(-1)


@torch.no_grad()
def slot_logits(drafter, target, samples: list[dict], anchors_per_forward: int = 32):
    """Yield (target_logits, draft_logits, drafted) for every chunk of anchors of every sample: the target's and the
    drafter's next-token logits (A, L, V) at the block's L = block_size - 1 draft slots (float32), and drafted (A, L)
    marking the slots inside the reply. Anchors: every reply position but the last; the prefix before a slot is the
    chat's own tokens (see the module docstring). One target forward per sample, one drafter forward per chunk."""
    config, lm_head, embedding = drafter.config, target.get_output_embeddings(), target.get_input_embeddings()
    block_size, device = config.block_size, next(drafter.parameters()).device
    for sample in samples:
        input_ids = torch.as_tensor(sample["input_ids"], device=device)[None]  # (1, S)
        loss_mask = torch.as_tensor(sample["loss_mask"], device=device)[None]
        anchors = torch.tensor([p for s, e in reply_spans(sample["loss_mask"]) for p in range(s, e - 1)], device=device)
        if not len(anchors):
            continue
        positions = torch.arange(1, input_ids.shape[1], device=device)
        features, target_logits = compute_target_features_and_logits(
            target, input_ids, config.target_layer_ids, None, torch.stack([torch.zeros_like(positions), positions], 1)
        )  # target_logits (S - 1, V): row i predicts the token at position i + 1
        features = features.to(next(drafter.parameters()).dtype)
        for chunk in anchors.split(anchors_per_forward):
            valid = torch.ones_like(chunk[None], dtype=torch.bool)
            blocks = build_blocks(input_ids, loss_mask, chunk[None], valid, block_size, config.mask_token_id, 1.0)
            batch = {"input_ids": input_ids, "anchor_positions": chunk[None], "anchor_valid": valid, **blocks}
            hidden = dflash_training_forward(drafter, embedding, batch, features, config)  # (1, A*bs, H)
            hidden = hidden.view(len(chunk), block_size, -1)[:, 1:]  # (A, L, H) the draft slots
            draft_logits = drafter.draft_logits(hidden, lm_head).float()  # (A, L, V)
            slot_positions = (chunk[:, None] + torch.arange(1, block_size, device=device)).clamp(
                max=input_ids.shape[1] - 1
            )
            slot_target = target_logits[slot_positions - 1].float()  # (A, L, V) predicts the token at each slot
            drafted = (blocks["loss_weights"].view(len(chunk), block_size)[:, 1:] > 0).float()
            yield slot_target, draft_logits, drafted


def check_temperatures(temperatures: list[float], draft_temperatures=()) -> None:
    """ValueError naming a sampling or draft temperature that is not > 0 (None: a draft at the call's own)."""
    if not temperatures or any(t <= 0 for t in temperatures):
        raise ValueError(f"temperatures={temperatures!r}: give one or more sampling temperatures > 0.")
    for draft_temperature in draft_temperatures:
        if draft_temperature is not None and not draft_temperature > 0:
            raise ValueError(f"draft_temperature={draft_temperature!r}: give a temperature > 0 (or None: the call's).")


def slot_distributions(
    drafter,
    target,
    samples: list[dict],
    temperatures: list[float],
    anchors_per_forward: int = 32,
    draft_temperature: float | None = None,
):
    """Yield (T, p, q, drafted) for each chunk of `slot_logits` and each temperature T > 0: the target's next-token
    distribution p (A, L, V) and the drafter's q (A, L, V) at T (q at `draft_temperature` instead when given, as
    `drafter.draft_temperature` drafts), and drafted (A, L)."""
    check_temperatures(temperatures, (draft_temperature,))
    for slot_target, draft_logits, drafted in slot_logits(drafter, target, samples, anchors_per_forward):
        for t in temperatures:
            yield t, (slot_target / t).softmax(-1), (draft_logits / (draft_temperature or t)).softmax(-1), drafted


def draft_temperature_taus(
    drafter, target, samples: list[dict], temperatures: list[float], draft_temperatures: list[float]
) -> dict[float, dict[float, float]]:
    """{T': {T: mean expected τ}} of drafts sampled from q at each draft temperature T' when `generate` samples at T
    (the "sample" rule), every pair from one pass of `slot_logits`."""
    check_temperatures(temperatures, draft_temperatures)
    taus = {draft_t: {t: [] for t in temperatures} for draft_t in draft_temperatures}
    for slot_target, draft_logits, drafted in slot_logits(drafter, target, samples):
        qs = {draft_t: (draft_logits / draft_t).softmax(-1) for draft_t in draft_temperatures}  # once per chunk
        for t in temperatures:
            p = (slot_target / t).softmax(-1)
            for draft_t, q in qs.items():
                taus[draft_t][t].append(expected_chain_tau(draft_acceptance(p, q, "sample"), drafted))
    return {
        draft_t: {t: round(float(torch.cat(v).mean()), 4) if v else 0.0 for t, v in by.items()}
        for draft_t, by in taus.items()
    }


def sampling_tau_estimate(
    drafter,
    target,
    samples: list[dict],
    temperatures: list[float],
    rules: tuple[str, ...] = DRAFT_RULES,
    anchors_per_forward: int = 32,
    draft_temperature: float | None = None,
) -> dict[float, dict[str, float]]:
    """{T: {rule: mean expected τ over every anchor}} of `drafter` on `samples` (`{"input_ids", "loss_mask"}`), for
    each sampling temperature T > 0 and draft rule (`draft_acceptance`); `draft_temperature`: the drafter's q at that
    temperature rather than the call's (the argmax and top-N rules do not change)."""
    for rule in rules:
        rule_width(rule)  # names an unknown rule before any forward
    taus = {t: {rule: [] for rule in rules} for t in temperatures}
    slots = slot_distributions(drafter, target, samples, temperatures, anchors_per_forward, draft_temperature)
    for t, p, q, drafted in slots:
        for rule in rules:
            taus[t][rule].append(expected_chain_tau(draft_acceptance(p, q, rule), drafted))
    return {
        t: {rule: round(float(torch.cat(v).mean()), 4) if v else 0.0 for rule, v in by.items()}
        for t, by in taus.items()
    }
