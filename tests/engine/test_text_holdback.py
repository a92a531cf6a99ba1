"""text_holdback.partial_stop_suffix against the brute force it replaces: every candidate length
tried, longest first."""
from hypothesis import example, given, settings, strategies as st

from adaspec.text_holdback import TAIL, partial_stop_suffix


def brute(text: str, stops) -> int:
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


# small alphabets, and lengths on both sides of TAIL, so that long and short candidates both match
_text = st.text(alphabet="ab", max_size=3 * TAIL) | st.text(alphabet="abc\u00e9", max_size=3 * TAIL)


@settings(max_examples=600, deadline=None)
@given(text=_text, stops=st.lists(st.text(alphabet="abc\u00e9", min_size=1, max_size=3 * TAIL), min_size=1,
                                  max_size=3))
@example(text="aaab" + "a" * 16, stops=["a" * 18])  # the tail matches at n = 17 (no), then n = 16 (yes)
def test_partial_stop_suffix_is_the_longest_held_prefix(text, stops):
    assert partial_stop_suffix(text, stops) == brute(text, stops)


def test_a_prefix_longer_than_the_tail_and_one_shorter():
    stop = "x" * 5 + "ab" * TAIL + "END"
    text = "prefix " + stop[: 2 * TAIL + 3]
    assert partial_stop_suffix(text, [stop]) == 2 * TAIL + 3
    assert partial_stop_suffix("...ab", [stop, "abZ"]) == 2
    assert partial_stop_suffix("abc", ["abc"]) == 0  # a whole stop string is a match, not a prefix
