"""What the target decides in a round: the tokens each row commits (greedy acceptance or rejection sampling)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..drafting.proposal import Proposal
from .acceptance_rules import accepted_lengths, greedy_tokens, process_rows, sample_rows
from .tree_verification import greedy_tree_path, multi_draft_sample_path, process_tree_logits, sampled_tree_path


@dataclass
class Verdict:
    """new_tokens (R, d+1), row b's valid up to n_b + 1; num_accepted n_b (R,); the processed and raw target
    logits (R, d+1, V) and the forward's hidden states, laid out along the accepted path when a tree was
    verified (`path`: its nodes, root first)."""

    new_tokens: torch.LongTensor
    num_accepted: torch.LongTensor
    processed: torch.Tensor
    raw_logits: torch.Tensor
    hidden_states: tuple
    path: list[int] | None = None


def judge(proposal: Proposal, outputs, prefixes, logits_processor, do_sample: bool, batch_size: int, rows) -> Verdict:
    """The target's verdict on `proposal` from its verification `outputs`. prefixes: each active row's committed
    tokens; rows: their indices in the original batch of `batch_size` (logits processors see each row there)."""
    drafts = proposal.drafts
    raw_logits = outputs.logits[:, -drafts.tokens.shape[1] - 1 :].float()
    if proposal.tree is not None:
        return judge_tree(proposal, raw_logits, outputs.hidden_states, prefixes[0], logits_processor, do_sample)
    processed = process_rows(logits_processor, batch_size, rows, prefixes, drafts.tokens, raw_logits)
    if do_sample:
        new_tokens, num_accepted = sample_rows(
            drafts.tokens, draft_distributions(drafts, raw_logits.shape[-1]), processed.softmax(-1)
        )
    else:
        new_tokens = greedy_tokens(processed)  # (R, d+1): the target's token after each prefix
        num_accepted = accepted_lengths(drafts.tokens, new_tokens)
    return Verdict(new_tokens, num_accepted, processed, raw_logits, outputs.hidden_states)


def draft_distributions(drafts, vocab_size: int) -> torch.Tensor | None:
    """(R, d, V) the distributions the drafts were drawn from: their own, or one-hot for deterministic drafts that
    carry none (a drafter tree's nodes, an n-gram copy: rejection sampling then accepts each with p(draft))."""
    if drafts.scores is not None or not drafts.tokens.shape[1]:
        return drafts.scores
    return torch.nn.functional.one_hot(drafts.tokens, vocab_size).float()


def judge_tree(proposal: Proposal, raw_logits, hidden_states, prefix, logits_processor, do_sample: bool) -> Verdict:
    """The longest accepted path through the proposal's tree (batch 1), its outputs laid out along that path as if
    it had been a chain. Sampling: drafts with the distributions they were drawn from (`Drafts.scores`, (1, N-1, V))
    go through recursive rejection sampling, deterministic ones through the target's own draws."""
    tree = proposal.tree
    processed = process_tree_logits(logits_processor, prefix[None], tree, raw_logits)
    if do_sample:
        target_probs, draft_probs = processed[0].softmax(-1), proposal.drafts.scores
        if draft_probs is None:
            path, last = sampled_tree_path(tree, target_probs)
        else:  # node 0, the root, was not drafted: its row is never read
            path, last = multi_draft_sample_path(tree, target_probs, torch.cat([draft_probs[0, :1], draft_probs[0]]))
        new_tokens = torch.cat([tree.tokens[path[1:]].to(last.device), last])[None]
    else:
        path = greedy_tree_path(tree, greedy_tokens(processed[0]))
        new_tokens = greedy_tokens(processed[:, path])
    hidden = tuple(None if h is None else h[:, path] for h in hidden_states)
    num_accepted = torch.tensor([len(path) - 1])
    return Verdict(new_tokens, num_accepted, processed[:, path], raw_logits[:, path], hidden, path)
