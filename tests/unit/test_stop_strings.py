"""Stop strings matched incrementally (engine/stop_strings.py) against the plain definition: the first stop string
to end in the text, cut where it begins, and the longest end of the text that may still become one."""

from __future__ import annotations

import random

import pytest

from engine.stop_strings import StopStrings


def first_stop(text: str, stops: list[str]) -> int | None:
    """Where the text is cut: the start of the stop string that ends first (the earliest end, then the longest)."""
    ends = [(text.find(s) + len(s), -len(s), text.find(s)) for s in stops if s in text]
    return min(ends)[2] if ends else None


def held_back(text: str, stops: list[str]) -> int:
    return max((k for s in stops for k in range(len(s) - 1, 0, -1) if text.endswith(s[:k])), default=0)


@pytest.mark.parametrize("seed", range(300))
def test_fed_in_pieces_it_finds_what_the_whole_text_shows(seed):
    rng = random.Random(seed)
    alphabet = "ab" if seed % 2 else "abc"
    stops = ["".join(rng.choices(alphabet, k=rng.randint(1, 5))) for _ in range(rng.randint(1, 4))]
    text = "".join(rng.choices(alphabet, k=rng.randint(0, 40)))
    matcher, fed = StopStrings(stops), ""
    while True:
        piece = text[len(fed) : len(fed) + rng.randint(1, 4)]
        before = len(fed)
        fed += piece
        cut = matcher.feed(piece) if piece else None
        if cut is not None:
            assert before + cut == first_stop(fed, stops)
            assert first_stop(fed[: len(fed) - len(piece)], stops) is None  # found as soon as it ended
            return
        assert first_stop(fed, stops) is None
        assert matcher.held_back == held_back(fed, stops)
        if len(fed) == len(text):
            return


def test_overlapping_and_repeated_starts():
    assert StopStrings(["aab", "abab"]).feed("aaaba") == 1
    matcher = StopStrings(["aab", "abab"])
    assert matcher.feed("aaa") is None and matcher.held_back == 2
    assert matcher.feed("b") == -2  # "aab" began two characters before this piece
    assert StopStrings(["abab"]).feed("xababa") == 1
    assert StopStrings(["b", "ab"]).feed("xab") == 1  # both end at the "b": the longer is cut whole


def test_no_stop_strings_hold_nothing_back():
    matcher = StopStrings([])
    assert matcher.feed("anything at all") is None and matcher.held_back == 0


def test_the_longest_allowed_stop_strings_cost_linear_time():
    """16 stop strings of 1,024 characters that almost match everywhere: the text is fed once, character by
    character, with amortised constant work per character and string (KMP), so 20,000 characters take well under
    a second here; the quadratic check this replaced took minutes for far less."""
    stops = ["a" * 1023 + chr(ord("b") + i) for i in range(16)]
    matcher = StopStrings(stops)
    for _ in range(20):
        assert matcher.feed("a" * 1000) is None
    assert matcher.held_back == 1023
    assert matcher.feed("c") == -1023
