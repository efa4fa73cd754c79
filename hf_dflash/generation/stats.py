"""What one `generate` call with a DFlash assistant measured: acceptance per round, block sizes, trees."""

from dataclasses import dataclass, field


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

    def record_round(self, block_length: int, committed: list[int], in_prefill: bool) -> None:
        """A verification round of block length k whose rows committed these tokens."""
        self.block_sizes.append(block_length)
        self.acceptance_lengths.extend(committed)
        self.first_round_in_prefill |= in_prefill

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
