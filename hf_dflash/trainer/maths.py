"""The DFlash training recipe (anchors, masked blocks, decayed loss weights) as pure functions (no Trainer, no model state).

Shapes: B = batch, S = sequence length, A = anchors per sequence, bs = block size, V = vocabulary.
Blocks are laid out anchor-major: flat index a * bs + k is slot k of anchor a.
"""

import math

import torch
import torch.nn.functional as F

PAPER_DECAY_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_decay_gamma(block_size: int) -> float:
    """The paper's gamma for block sizes 16/10/8; otherwise scaled like 16 -> 7 (7/16 of the block)."""
    return PAPER_DECAY_GAMMA.get(block_size, block_size * 7.0 / 16.0)


def decay_weights(block_size: int, gamma: float) -> torch.Tensor:
    """(bs,) slot weights: 0 for the anchor slot, exp(-(k - 1) / gamma) for slot k >= 1."""
    slots = torch.arange(block_size, dtype=torch.float32)
    weights = torch.exp(-(slots - 1) / gamma)
    weights[0] = 0.0
    return weights


def reply_offsets(loss_mask: torch.Tensor) -> torch.LongTensor:
    """(B, S) each supervised position's offset from the start of its reply (its maximal run of supervised
    positions: a multi-turn chat restarts at 0 in every reply); 0 outside the replies."""
    mask = loss_mask.bool()
    index = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    starts = mask.clone()
    starts[:, 1:] &= ~mask[:, :-1]
    run_start = torch.where(starts, index, torch.zeros_like(index)).cummax(-1).values
    return torch.where(mask, index - run_start, torch.zeros_like(index))


def anchor_draw_weights(loss_mask: torch.Tensor, decay_tokens: float) -> torch.Tensor:
    """(B, S) the relative chance of each position to be drawn as an anchor: 1 / (1 + d / decay_tokens) at
    reply offset d (the reply's first token 1, its `decay_tokens`-th 1/2), decay_tokens > 0. Serving visits
    the first tokens of every reply, where the drafter has the least context of the reply and τ is lowest;
    a short generation is made of nothing else."""
    return 1.0 / (1.0 + reply_offsets(loss_mask).float() / decay_tokens)


def select_anchors(
    loss_mask: torch.Tensor,
    num_anchors: int,
    generator: torch.Generator | None = None,
    decay_tokens: float = 0.0,
) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """Draw up to `num_anchors` anchor positions per sequence, without replacement.

    loss_mask (B, S). Candidates are positions p with loss_mask[p] == loss_mask[p + 1] == 1 (the
    anchor and at least its first prediction are supervised). Uniform over the candidates, or with
    `decay_tokens` > 0 weighted by `anchor_draw_weights` (a single draw picks p with probability
    w(p) / sum(w)). Returns anchor_positions (B, A) sorted ascending and anchor_valid (B, A),
    A = min(num_anchors, most candidates in any row); rows with fewer candidates are padded with
    position 0 and valid = False.
    """
    mask = loss_mask.bool()
    candidates = torch.zeros_like(mask)
    candidates[:, :-1] = mask[:, :-1] & mask[:, 1:]
    count = int(candidates.sum(-1).max()) if candidates.numel() else 0
    width = max(1, min(num_anchors, count))
    keys = torch.rand(candidates.shape, generator=generator, device=loss_mask.device)
    # keys on candidates, `outside` elsewhere: the top-k keys are the draw without replacement
    if decay_tokens == 0:  # uniform keys u
        outside = -1.0
    else:  # log(u) / w(p), kept in log space (u ** (1 / w) underflows): weighted (Efraimidis and Spirakis, 2006)
        outside = -math.inf
        keys = keys.clamp_min(torch.finfo(keys.dtype).tiny).log() / anchor_draw_weights(loss_mask, decay_tokens)
    keys = torch.where(candidates, keys, torch.full_like(keys, outside))
    top_keys, top_positions = keys.topk(width, dim=-1)
    valid = top_keys > outside
    positions = torch.where(valid, top_positions, torch.zeros_like(top_positions))
    order = torch.where(valid, positions, torch.full_like(positions, loss_mask.shape[1])).argsort(-1)
    return positions.gather(-1, order), valid.gather(-1, order)


def build_blocks(
    input_ids: torch.LongTensor,
    loss_mask: torch.Tensor,
    anchor_positions: torch.LongTensor,
    anchor_valid: torch.BoolTensor,
    block_size: int,
    mask_token_id: int,
    gamma: float,
) -> dict[str, torch.Tensor]:
    """Blocks `[x_p, MASK x (bs-1)]` at positions p..p+bs-1 with same-position labels.

    input_ids, loss_mask (B, S); anchor_positions, anchor_valid (B, A). Returns (B, A*bs) tensors:
      block_ids        anchor token then mask_token_id,
      block_positions  p + k,
      labels           x_{p+k} (0 where p+k >= S; such slots have weight 0),
      loss_weights     exp(-(k-1)/gamma) * loss_mask[p+k] * [p+k < S] * valid, 0 for slot 0.
    The mask is placed by slot index, never by comparing token values, so a real token equal to
    mask_token_id keeps its label and weight.
    """
    batch, seq_len = input_ids.shape
    slots = torch.arange(block_size, device=input_ids.device)
    positions = anchor_positions[..., None] + slots  # (B, A, bs)
    inside = positions < seq_len
    clamped = positions.clamp(max=seq_len - 1)
    tokens = input_ids.gather(1, clamped.flatten(1)).view_as(positions)
    supervised = loss_mask.gather(1, clamped.flatten(1)).view_as(positions).float()
    block_ids = torch.full_like(tokens, mask_token_id)
    block_ids[..., 0] = tokens[..., 0]
    weights = decay_weights(block_size, gamma).to(input_ids.device) * supervised * inside * anchor_valid[..., None]
    return {
        "block_ids": block_ids.flatten(1),
        "block_positions": positions.flatten(1),
        "labels": torch.where(inside, tokens, torch.zeros_like(tokens)).flatten(1),
        "loss_weights": weights.flatten(1),
    }


def build_training_mask(
    anchor_positions: torch.LongTensor,
    anchor_valid: torch.BoolTensor,
    seq_len: int,
    block_size: int,
    sliding_window: int | None = None,
    block_causal: bool = False,
) -> torch.BoolTensor:
    """(B, 1, A*bs, S + A*bs) boolean attention mask of the packed multi-block forward.

    Keys are [S context tokens, A*bs block tokens]. A query of block b sees context keys j < p_b
    (strictly: the anchor's own hidden state is not visible) and every key of its own block, nothing
    else (no other block, so overlapping blocks never see each other's future). Padding blocks see
    only their own block: no row is fully masked (SDPA would return NaN) and their zero weight keeps
    them out of the loss.

    A sliding-window layer's mask (`sliding_window`, as serving masks it): the query at position p_b + k
    also needs the key's position above p_b + k - sliding_window (context key j at j, block slot m at
    p_b + m), and with `block_causal` only slots m <= k of its block.
    """
    batch, num_anchors = anchor_positions.shape
    device = anchor_positions.device
    context = torch.arange(seq_len, device=device)[None, None, :] < anchor_positions[..., None]  # (B, A, S)
    context = context & anchor_valid[..., None]
    context = context.repeat_interleave(block_size, dim=1)  # (B, A*bs, S)
    flat = torch.arange(num_anchors * block_size, device=device)
    block_of, slot = flat // block_size, flat % block_size  # (A*bs,) each
    own_block = block_of[:, None] == block_of[None, :]  # (A*bs, A*bs)
    if sliding_window is not None:
        query_position = anchor_positions.repeat_interleave(block_size, dim=1) + slot  # (B, A*bs)
        context = context & (query_position[..., None] - torch.arange(seq_len, device=device) < sliding_window)
        own_block = own_block & (slot[:, None] - slot[None, :] < sliding_window)
        if block_causal:
            own_block = own_block & (slot[None, :] <= slot[:, None])
    return torch.cat([context, own_block.expand(batch, -1, -1)], dim=-1)[:, None]


def training_mask_mod(
    anchor_positions: torch.LongTensor,
    anchor_valid: torch.BoolTensor,
    seq_len: int,
    block_size: int,
    sliding_window: int | None = None,
    block_causal: bool = False,
):
    """The rule of `build_training_mask` as a flex-attention `mask_mod(b, h, q_idx, kv_idx)`: query q is
    slot q % bs of block q // bs; key kv < S is context position kv, key kv >= S is block token kv - S."""

    def mask_mod(batch, head, q_idx, kv_idx):
        block, slot = q_idx // block_size, q_idx % block_size
        anchor = anchor_positions[batch, block]
        sees_context = (kv_idx < seq_len) & (kv_idx < anchor) & anchor_valid[batch, block]
        sees_own_block = (kv_idx >= seq_len) & ((kv_idx - seq_len) // block_size == block)
        if sliding_window is not None:
            key_slot = (kv_idx - seq_len) % block_size
            sees_context = sees_context & (anchor + slot - kv_idx < sliding_window)
            sees_own_block = sees_own_block & (slot - key_slot < sliding_window)
            if block_causal:
                sees_own_block = sees_own_block & (key_slot <= slot)
        return sees_context | sees_own_block

    return mask_mod


def build_training_block_mask(
    anchor_positions: torch.LongTensor,
    anchor_valid: torch.BoolTensor,
    seq_len: int,
    block_size: int,
    sliding_window: int | None = None,
    block_causal: bool = False,
):
    """Flex-attention `BlockMask` of the packed forward (same rule as `build_training_mask`): only the
    tiles that hold visible keys are computed, which is what makes 512 anchors affordable on GPU."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, num_anchors = anchor_positions.shape
    queries = num_anchors * block_size
    mask_mod = training_mask_mod(anchor_positions, anchor_valid, seq_len, block_size, sliding_window, block_causal)
    return create_block_mask(mask_mod, batch, None, queries, seq_len + queries, device=anchor_positions.device)


def training_position_ids(block_positions: torch.LongTensor, seq_len: int) -> torch.LongTensor:
    """(B, S + A*bs) positions of [context tokens 0..S-1, block tokens]."""
    context = torch.arange(seq_len, device=block_positions.device).expand(block_positions.shape[0], -1)
    return torch.cat([context, block_positions], dim=1)


def target_to_draft_index(t2d: torch.BoolTensor) -> torch.LongTensor:
    """(V,) the draft index of each target id (ids ascending), -1 for ids outside the draft vocabulary."""
    index = t2d.long().cumsum(0) - 1
    return index.masked_fill(~t2d, -1)


def selected_logits(
    hidden_states: torch.Tensor,
    lm_head: torch.nn.Module,
    selected: torch.BoolTensor,
    draft_head: tuple[torch.Tensor, torch.LongTensor] | None = None,
) -> torch.Tensor:
    """float32 logits (N, V) at the N `selected` (B, T) positions of hidden_states (B, T, H), the LM head computed
    only there; (N, V') over a pruned draft vocabulary's rows (`draft_head`, see `position_cross_entropy`)."""
    if draft_head is None:
        return lm_head(hidden_states[selected].to(lm_head.weight.dtype)).float()  # the head may be bf16
    weight, _ = draft_head
    return F.linear(hidden_states[selected].to(weight.dtype), weight).float()


def position_cross_entropy(
    hidden_states: torch.Tensor,
    lm_head: torch.nn.Module,
    labels: torch.LongTensor,
    selected: torch.BoolTensor,
    draft_head: tuple[torch.Tensor, torch.LongTensor] | None = None,
    logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.BoolTensor, torch.BoolTensor]:
    """Cross-entropy at the N `selected` positions, computing the LM head only there.

    hidden_states (B, T, H) (after the drafter's final norm), labels / selected (B, T).
    draft_head: for a pruned draft vocabulary, (weight (N', H): the LM-head rows of the N' draft ids,
        target_to_draft (V,): see `target_to_draft_index`); the softmax then runs over the N' ids, and a
        label outside them has loss 0 (it cannot be learnt) and is never correct.
    logits: `selected_logits` of these arguments when the caller already computed them.
    Returns (losses (N,), inside (N,) bool: the label can be drafted, correct (B, T) bool: argmax == label,
    False where not selected).
    """
    chosen = labels[selected]
    if logits is None:
        logits = selected_logits(hidden_states, lm_head, selected, draft_head)
    if draft_head is None:
        inside = torch.ones_like(chosen, dtype=torch.bool)
    else:
        _, target_to_draft = draft_head
        chosen = target_to_draft[chosen]
        inside = chosen >= 0
        chosen = chosen.clamp_min(0)
    losses = F.cross_entropy(logits, chosen, reduction="none") * inside
    correct = torch.zeros_like(selected)
    correct[selected] = (logits.argmax(-1) == chosen) & inside
    return losses, inside, correct


def block_predecessors(labels: torch.LongTensor, block_size: int) -> torch.LongTensor:
    """(B, A*bs) the true token before each slot's label: slot k's is slot k - 1's label (slot 1's: the
    anchor, which is slot 0's label); slot 0's is meaningless (never supervised)."""
    return labels.reshape(-1, block_size).roll(1, -1).reshape(labels.shape)


def selector_cross_entropy(
    logits: torch.Tensor,
    hidden_states: torch.Tensor,
    labels: torch.LongTensor,
    predecessors: torch.LongTensor,
    selector: torch.nn.Module,
    draft_ids: torch.LongTensor | None = None,
) -> tuple[torch.Tensor, torch.BoolTensor, torch.BoolTensor]:
    """DFlash2's K-way selector loss at N positions, teacher-forced.

    logits (N, V') the drafter's draft logits there; hidden_states (N, H) its outputs; labels (N,) the true
    tokens, predecessors (N,) the true token before each (the anchor for slot 1), target ids; `selector` a
    `DFlashCandidateSelector`; draft_ids (V',) the target ids of a pruned draft vocabulary's columns (None:
    V' is the vocabulary). Candidates: the K best columns of the logits (ranked without gradient), the label
    put in place of the K-th when it is missing, so every position has a target. Scores as the walk's:
    S[k] = logits[c_k] + < A[predecessor] * hidden_projection(h), B[c_k] >. Returns (losses (N,) = CE(S,
    label's index), 0 where the label is outside the draft vocabulary; in_top_k (N,) bool: the label was a
    candidate unaided; correct (N,) bool: argmax S == label and the label was a candidate).
    """
    columns = labels
    inside = torch.ones_like(labels, dtype=torch.bool)
    if draft_ids is not None:  # the label's column among the draft ids (-1 outside)
        index = torch.full((selector.predecessor_codebook.shape[0],), -1, dtype=torch.long, device=labels.device)
        index[draft_ids] = torch.arange(len(draft_ids), device=labels.device)
        columns = index[labels]
        inside = columns >= 0
        columns = columns.clamp_min(0)
    candidates = logits.detach().topk(selector.top_k, dim=-1).indices  # (N, K) columns
    in_top_k = (candidates == columns[:, None]).any(-1) & inside
    candidates[:, -1] = torch.where(in_top_k | ~inside, candidates[:, -1], columns)
    ids = candidates if draft_ids is None else draft_ids[candidates]  # target ids: the codebooks' rows
    weight = selector.hidden_projection.weight
    context = selector.predecessor_codebook[predecessors] * selector.hidden_projection(hidden_states.to(weight.dtype))
    pair = (selector.successor_codebook[ids] @ context.unsqueeze(-1)).squeeze(-1)  # (N, K)
    scores = logits.gather(-1, candidates) + pair.float()
    target = (candidates == columns[:, None]).int().argmax(-1)
    correct = (scores.argmax(-1) == target) & in_top_k
    return F.cross_entropy(scores, target, reduction="none") * inside, in_top_k, correct


def weighted_cross_entropy_sum(
    hidden_states: torch.Tensor,
    lm_head: torch.nn.Module,
    labels: torch.LongTensor,
    weights: torch.Tensor,
    draft_head: tuple[torch.Tensor, torch.LongTensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ w * CE over the positions with w > 0 (`position_cross_entropy`; a label outside a pruned draft
    vocabulary adds nothing, its weight still counts in the normaliser). weights (B, T).
    Returns (loss_sum scalar, correct (B, T) bool)."""
    selected = weights > 0
    losses, _, correct = position_cross_entropy(hidden_states, lm_head, labels, selected, draft_head)
    return (losses * weights[selected]).sum(), correct


def weighted_kl_sum(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    weights: torch.Tensor,
    draft_head: tuple[torch.Tensor, torch.LongTensor] | None = None,
) -> torch.Tensor:
    """Σ w * KL(p_teacher || q_draft) over N positions: `position_kl` weighted by `weights` (N,)."""
    return (position_kl(student_logits, teacher_logits, draft_head) * weights).sum()


def position_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    draft_head: tuple[torch.Tensor, torch.LongTensor] | None = None,
) -> torch.Tensor:
    """(N,) KL(p_teacher || q_draft) at N positions.

    student_logits (N, V') the drafter's logits there (`selected_logits`, over a pruned draft vocabulary's N'
    ids when `draft_head` is given, as in `position_cross_entropy`); teacher_logits (N, V) the target's (or
    (N, N') already over the draft ids, as `top_k_teacher_logits` gives them). With a draft vocabulary both
    distributions are taken over its N' ids (the teacher renormalised there): the drafter cannot propose the others.
    """
    teacher = teacher_logits.float()
    if draft_head is not None and teacher.shape[-1] != student_logits.shape[-1]:
        _, target_to_draft = draft_head
        teacher = teacher[:, (target_to_draft >= 0).nonzero().squeeze(1)]  # ascending: draft index order
    student = student_logits.float()
    return F.kl_div(student.log_softmax(-1), teacher.log_softmax(-1), log_target=True, reduction="none").sum(-1)


def top_k_teacher_logits(
    top_ids: torch.LongTensor,
    top_logprobs: torch.Tensor,
    vocab_size: int,
    target_to_draft: torch.LongTensor | None = None,
) -> torch.Tensor:
    """The target's distribution rebuilt from its cached top-K: (N, K) ids and log-probabilities -> (N, V) log-probs
    (or (N, N') over a draft vocabulary's ids, `target_to_draft` as in `target_to_draft_index`).

    The K kept exactly; the mass they leave, 1 - Σ p_k, spread evenly over the other V - K ids, so the rebuilt
    distribution is the target's wherever it matters and never zero (the KL stays finite). Exact when K = V.
    """
    n, k = top_ids.shape
    rest = (1 - top_logprobs.float().exp().sum(-1)).clamp_min(1e-12) / max(vocab_size - k, 1)  # (N,)
    columns, width = top_ids, vocab_size
    if target_to_draft is not None:
        columns, width = target_to_draft[top_ids], int((target_to_draft >= 0).sum())
    dense = rest.log()[:, None].expand(n, width).clone()
    kept = columns >= 0  # an id outside the draft vocabulary: the drafter cannot propose it
    rows = torch.arange(n, device=top_ids.device)[:, None].expand(n, k)
    dense[rows[kept], columns[kept]] = top_logprobs.float()[kept]
    return dense


def acceptance_estimate(
    correct: torch.BoolTensor, supervised: torch.BoolTensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-slot accuracy and the expected acceptance length τ estimated from per-slot correctness.

    correct, supervised (B, A*bs); slot 0 is ignored. τ of a block = 1 + Σ_k Π_{j<=k} correct_j
    (the drafts a greedy verifier would keep, plus the bonus); an unsupervised slot ends the chain.
    Returns float tensors that callers sum over steps and processes: correct counts (bs-1,),
    supervised counts (bs-1,), and [Σ τ, number of blocks] (2,) over blocks whose slot 1 is supervised.
    """
    correct = correct.reshape(-1, block_size)[:, 1:].float()
    supervised = supervised.reshape(-1, block_size)[:, 1:].float()
    live = supervised[:, 0] > 0
    tau = 1 + correct[live].cumprod(-1).sum(-1)
    return correct.sum(0), supervised.sum(0), torch.stack([tau.sum(), live.sum().float()])


def dpace_weights(confidence: torch.Tensor, valid: torch.BoolTensor, alpha: float = 0.5) -> torch.Tensor:
    """D-PACE position weights (arXiv 2605.18810): each draft slot weighted by its share of the expected
    accepted length, from the drafter's own current confidence instead of a fixed decay.

    confidence, valid (N, L): per block, the drafter's probability of the label at draft slots 1..L
    (exp(-CE), detached) and whether the slot is supervised. Confidence is smoothed toward 1,
    q~ = (1 - alpha) * q + alpha (alpha in (0, 1]); an unsupervised slot has q~ = 0, so nothing after it
    counts. w_j = sum_{m >= j} prod_{i <= m} q~_i: the probability that slot j is reached times the
    accepted length that follows. Returns detached (N, L) weights, 0 where not valid.
    """
    if not 0 < alpha <= 1:
        raise ValueError(f"dpace alpha must be in (0, 1], got {alpha!r}.")
    smoothed = torch.where(valid, (1 - alpha) * confidence.detach().float() + alpha, torch.zeros_like(confidence))
    reach = smoothed.cumprod(-1)  # (N, L) prod_{i <= m} q~_i
    suffix = reach.flip(-1).cumsum(-1).flip(-1)  # sum_{m >= j}
    return (suffix * valid).to(confidence.dtype)


def dpace_block_weights(
    losses: torch.Tensor, inside: torch.BoolTensor, selected: torch.BoolTensor, block_size: int, alpha: float
) -> torch.Tensor:
    """(B, T) D-PACE weights of a packed batch (blocks anchor-major, slot 0 = the anchor, weight 0).

    losses, inside (N,): `position_cross_entropy` at the N `selected` (B, T) positions. A label outside a
    pruned draft vocabulary has confidence 0: the drafter cannot propose it, so nothing after it counts.
    """
    confidence = torch.zeros(selected.shape, dtype=torch.float32, device=losses.device)
    confidence[selected] = torch.exp(-losses.detach().float()) * inside
    blocks = confidence.reshape(-1, block_size)[:, 1:]
    valid = selected.reshape(-1, block_size)[:, 1:]
    weights = torch.zeros_like(confidence).reshape(-1, block_size)
    weights[:, 1:] = dpace_weights(blocks, valid, alpha)
    return weights.reshape(selected.shape)
