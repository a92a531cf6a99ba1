"""Text a stream holds back because it may still become a marker: a stop string (the engine's stop
checker), a tool call's or a thinking's tag (the server's parsers). No heavy imports: the server's
formatting loads it."""
from __future__ import annotations


def partial_stop_suffix(text: str, stops) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string (text that
    may still become one; the server's parsers hold tags back with it too)."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
