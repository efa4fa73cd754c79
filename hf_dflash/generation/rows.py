"""The rows of one `generate` call: their committed tokens, where each stopped, which are still decoding."""

from __future__ import annotations

import torch

from .verifying.acceptance_rules import count_until_stop, row_copies


class Rows:
    """Row b's committed tokens are `sequences[b, :lengths[b]]` (left-padded prompts first); `active` holds the
    original index of each row still decoding, in the order the round's tensors hold them.

    With an EOS criterion plain `generate` pads finished rows; without one they keep decoding until every row
    has stopped, and the output then ends at the last stop (`cap`)."""

    def __init__(self, input_ids: torch.LongTensor, max_length: int, pad: int, pad_finished: bool):
        batch, prompt_length = input_ids.shape
        self.batch_size, self.pad, self.pad_finished = batch, pad, pad_finished
        self.sequences = input_ids.new_full((batch, max_length), pad)
        self.sequences[:, :prompt_length] = input_ids
        self.lengths = [prompt_length] * batch
        self.stop_lengths: dict[int, int] = {}  # row -> length at which a stopping criterion was met
        self.active = list(range(batch))
        self.cap = max_length  # without EOS padding: the common final length once all stopped
        self.round_starts = list(self.lengths)  # each row's length before the last commit

    def prefixes(self) -> list[torch.LongTensor]:
        """Each active row's committed tokens (L_b,)."""
        return [self.sequences[row, : self.lengths[row]] for row in self.active]

    def last_tokens(self) -> torch.LongTensor:
        """(R,) each active row's last committed token: the bonus, which the target has not read yet."""
        return torch.stack([self.sequences[row, self.lengths[row] - 1] for row in self.active])

    def room(self) -> int:
        """The most drafts any active row can still take before its final length (the bonus excluded)."""
        return max(self.cap - self.lengths[row] - 1 for row in self.active)

    def commit(self, new_tokens: torch.LongTensor, num_accepted: torch.LongTensor, stopping_criteria, scores):
        """Write each active row's new tokens (R, d+1), row i's valid up to num_accepted[i] + 1, one by one up to
        its first stop, as plain decoding would. Returns the tokens each row committed (R,)."""
        starts = self.round_starts = list(self.lengths)
        for i, row in enumerate(self.active):
            start = self.lengths[row]
            tokens = new_tokens[i, : int(num_accepted[i]) + 1][: self.cap - start]
            end = start + len(tokens)
            self.sequences[row, start:end] = tokens
            if row not in self.stop_lengths:
                copies = row_copies(self.sequences[row, :end], self.batch_size)
                kept, stopped = count_until_stop(stopping_criteria, copies, start, scores, row=row)
                if stopped:
                    self.stop_lengths[row] = start + kept
                    if self.pad_finished:
                        self.sequences[row, start + kept : end] = self.pad
                        end = start + kept
            self.lengths[row] = end
        if not self.pad_finished and len(self.stop_lengths) == self.batch_size:
            self.cap = max(self.stop_lengths.values())  # plain decoding stops when the last row does
        return torch.tensor([min(self.lengths[row], self.cap) - starts[row] for row in self.active])

    def still_decoding(self) -> list[int]:
        """Indices (into `active`) of the rows that have not finished (EOS padding, or the final length)."""
        return [
            i
            for i, row in enumerate(self.active)
            if not ((self.pad_finished and row in self.stop_lengths) or self.lengths[row] >= self.cap)
        ]

    def keep(self, indices: list[int]) -> None:
        self.active = [self.active[i] for i in indices]

    def output(self) -> torch.LongTensor:
        """The sequences (B, L) as plain `generate` returns them."""
        width = max(min(length, self.cap) for length in self.lengths)
        return self.sequences[:, :width]
