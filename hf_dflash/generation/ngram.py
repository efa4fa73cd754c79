"""The n-gram draft source of hybrid drafting: continue the latest earlier occurrence of the longest
suffix n-gram (n <= max_ngram_size) of the prompt + generated text, as prompt-lookup decoding does.

Two choices differ from Transformers' `PromptLookupCandidateGenerator`: the LATEST occurrence wins (a
model that repeats itself repeats what it just wrote), and a continuation that runs into the end of the
text keeps copying (an overlapping copy, as in LZ77): after "a b a b" it drafts "a b a ...", so a run or
a repeated line is drafted to its full length instead of stopping at the text's end.
"""

import torch


def ngram_continuation(sequence: torch.LongTensor, max_ngram_size: int, num_tokens: int) -> torch.LongTensor:
    """(<= num_tokens,) drafted tokens after `sequence` (L,); empty when no suffix n-gram occurred before.

    For n = min(max_ngram_size, L - 1) down to 1: if sequence[-n:] also starts at some i < L - n, take the
    largest such i and return x[i+n], x[i+n+1], ... (num_tokens of them), where x is the sequence extended
    by its own continuation (x[L + t] = x[i + n + t]).
    """
    if max_ngram_size < 1:
        raise ValueError(f"max_ngram_size must be >= 1, got {max_ngram_size}.")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}.")
    length = sequence.shape[0]
    for n in range(min(max_ngram_size, length - 1), 0, -1):
        # windows start at 0 .. L-1-n: every occurrence except the suffix itself
        windows = sequence[:-1].unfold(0, n, 1)
        matches = (windows == sequence[-n:]).all(1).nonzero()
        if len(matches):
            start = int(matches[-1, 0]) + n
            period = length - start  # >= 1: the copy repeats the last `period` tokens
            index = start + torch.arange(num_tokens, device=sequence.device) % period
            return sequence[index]
    return sequence[:0]
