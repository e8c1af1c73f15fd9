"""Stop strings: limited in count and length (a ClientError, a 400), and matched incrementally by an
automaton that finds what a search of every stop string in the text would find."""

from __future__ import annotations

import random

import pytest

from mmserve.errors import ClientError
from mmserve.frontend.output.stop_matcher import StopMatcher
from mmserve.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams


def test_too_many_or_too_long_stop_strings_are_client_errors():
    with pytest.raises(ClientError, match="at most"):
        SamplingParams(stop=[f"s{i}" * 50 for i in range(10_000)])
    with pytest.raises(ClientError, match="at most"):
        SamplingParams(stop=[f"{i}" for i in range(MAX_STOP_STRINGS + 1)])
    with pytest.raises(ClientError, match="characters"):
        SamplingParams(stop=["x" * (MAX_STOP_CHARS + 1)])
    SamplingParams(stop=["x" * MAX_STOP_CHARS] + [f"{i}" for i in range(MAX_STOP_STRINGS - 1)])


def naive(text: str, start: int, stops: list[str]) -> tuple[int, int] | None:
    """The old search: of the stop strings ending at or after `start`, the one starting first."""
    best = None
    for stop in stops:
        i = text.find(stop, max(0, start - len(stop) + 1))
        if i != -1 and (best is None or i < best[0] or (i == best[0] and i + len(stop) < best[1])):
            best = (i, i + len(stop))
    return best


def pending(text: str, stops: list[str]) -> int:
    return max((n for n in range(1, len(text) + 1) for s in stops if len(s) > n and s.startswith(text[-n:])),
               default=0)


@pytest.mark.parametrize("seed", range(20))
def test_the_automaton_finds_what_a_search_of_every_stop_finds(seed):
    rng = random.Random(seed)
    alphabet = "abc"
    stops = list({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 8))})
    matcher, text = StopMatcher(tuple(stops)), ""
    for _ in range(30):
        chunk = "".join(rng.choice(alphabet + "xy") for _ in range(rng.randint(1, 4)))
        start, text = len(text), text + chunk
        found = matcher.feed(chunk, start, report=True)
        assert found == naive(text, start, stops), (stops, text)
        if found is not None:
            return
        assert matcher.pending == pending(text, stops)


def test_a_match_spanning_updates_and_the_held_back_tail():
    matcher = StopMatcher(("</tool>", "END"))
    assert matcher.feed("hello </to", 0, report=True) is None and matcher.pending == 4
    assert matcher.feed("ol> more", 10, report=True) == (6, 13)
