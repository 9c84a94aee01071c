"""StopMatcher (Aho-Corasick) against a brute-force search, over random stops and random splits of the text."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.engine.stop_strings import StopMatcher

words = st.text(alphabet="abc", min_size=1, max_size=5)


def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The stop string ending first (longest of those ending together), with its start."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            best = max(ending, key=len)
            return end - len(best), best
    return None


def partial(text: str, stops: list[str]) -> int:
    return max((k for s in stops for k in range(1, len(s) + 1) if text.endswith(s[:k])), default=0)


@settings(max_examples=300, deadline=None)
@given(stops=st.lists(words, min_size=1, max_size=6), text=st.text(alphabet="abcd", max_size=30),
       cuts=st.lists(st.integers(0, 30), max_size=6))
def test_matches_brute_force_however_split(stops, text, cuts):
    m = StopMatcher(stops)
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    found = None
    for a, b in zip(bounds, bounds[1:]):
        hit = m.feed(text[a:b])
        if hit is not None and found is None:
            found = (a + hit[0], hit[1])
        if found is None:
            assert m.partial == partial(text[:b], stops)
    expected = first_stop(text, stops)
    assert found == expected


def test_many_long_stops_read_each_character_once():
    stops = [f"{i:04d}" * 25 for i in range(2_000)]  # 2,000 stops of 100 characters
    m = StopMatcher(stops)
    assert m.feed("9876" * 100) is None
    assert m.feed(stops[1234]) == (0, stops[1234])
