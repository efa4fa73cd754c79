"""The n-gram draft source (`hf_dflash.generation.drafting.ngram`): by hand and against a brute-force search."""

import pytest
import torch

from hf_dflash.generation.drafting.ngram import match_bucket, ngram_match


def continuation(values, max_ngram_size=2, num_tokens=4) -> list[int]:
    return ngram_match(torch.tensor(values), max_ngram_size, num_tokens)[0].tolist()


def test_continues_the_latest_match_of_the_longest_suffix():
    # suffix (7, 8) occurs at 0 and 4; the latest (4) is followed by 9, 1, then the sequence's own end
    assert continuation([7, 8, 5, 6, 7, 8, 9, 1, 3, 7, 8], num_tokens=3) == [9, 1, 3]
    # the 2-gram (3, 8) never occurred: fall back to the 1-gram 8, latest at 5
    assert continuation([7, 8, 5, 6, 7, 8, 9, 1, 3, 8], num_tokens=2) == [9, 1]
    # a 3-gram match beats a more recent 2-gram match
    assert continuation([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3], max_ngram_size=3, num_tokens=2) == [4, 9]
    assert continuation([1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3], max_ngram_size=2, num_tokens=2) == [5, 1]


def test_a_continuation_running_into_the_end_keeps_copying_the_repeat():
    # "a b a b": the match at 0 is followed by (a, b), then the copy continues with what it just copied
    assert continuation([4, 5, 4, 5], num_tokens=5) == [4, 5, 4, 5, 4]
    assert continuation([6, 6, 6], num_tokens=3) == [6, 6, 6]


def test_no_match_or_no_room_gives_nothing():
    assert continuation([1, 2, 3, 4]) == []
    assert continuation([5]) == []
    assert continuation([4, 5, 4, 5], num_tokens=0) == []


def test_refuses_bad_settings():
    with pytest.raises(ValueError, match="max_ngram_size"):
        continuation([1, 1], max_ngram_size=0)
    with pytest.raises(ValueError, match="num_tokens"):
        continuation([1, 1], num_tokens=-1)


def brute_force(values: list[int], max_ngram_size: int, num_tokens: int) -> list[int]:
    for n in range(min(max_ngram_size, len(values) - 1), 0, -1):
        starts = [i for i in range(len(values) - n) if values[i : i + n] == values[-n:]]
        if starts:
            extended = list(values)
            source = starts[-1] + n
            while len(extended) < len(values) + num_tokens:
                extended.append(extended[source])
                source += 1
            return extended[len(values) :]
    return []


def test_matches_brute_force_on_random_sequences():
    generator = torch.Generator().manual_seed(0)
    for _ in range(500):
        length = int(torch.randint(1, 30, (1,), generator=generator))
        values = torch.randint(0, 4, (length,), generator=generator).tolist()
        n, m = int(torch.randint(1, 5, (1,), generator=generator)), int(torch.randint(0, 8, (1,), generator=generator))
        assert continuation(values, n, m) == brute_force(values, n, m), (values, n, m)


def test_match_length_and_bucket():
    assert ngram_match(torch.tensor([7, 8, 5, 6, 7, 8, 9, 1, 3, 7, 8]), 8, 3)[1] == 2
    drafts, length = ngram_match(torch.tensor([1, 2, 3, 4, 9, 1, 2, 3]), 8, 3)
    assert drafts.tolist() == [4, 9, 1] and length == 3
    assert ngram_match(torch.tensor([1, 2, 3, 4, 9, 1, 2, 3]), 2, 3)[1] == 2  # capped at max_ngram_size
    assert ngram_match(torch.tensor([1, 2, 3]), 8, 3)[1] == 0
    assert [match_bucket(n) for n in (1, 2, 3, 4, 8)] == [0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="match_bucket"):
        match_bucket(0)
