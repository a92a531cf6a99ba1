"""Text a stream holds back because it may still become a marker: a stop string (the engine's stop
checker), a tool call's or a thinking's tag (the server's parsers). No heavy imports: the server's
formatting loads it."""
from __future__ import annotations


TAIL = 16  # characters of the text's end that a long candidate is searched for by (partial_stop_suffix)


def partial_stop_suffix(text: str, stops) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string (text that
    may still become one; the server's parsers hold tags back with it too).

    Checked for every token of a request with stop strings, so its cost is kept to C-speed scans: a
    candidate length n >= TAIL must have the text's last TAIL characters end at s[n - 1], which
    str.rfind finds; the lengths below TAIL are tried one by one. (Trying every n copied and compared
    s[:n] for each: #stops x len(text)^2 / 2 characters a token, seconds a step for requests with
    many long stop strings.)"""
    best, size = 0, len(text)
    for s in stops:
        hi = min(len(s) - 1, size)  # the longest proper prefix that could fit
        if hi <= best:
            continue
        m = min(TAIL, hi)
        tail = text[size - m:]
        lo = max(best + 1 - m, 0)  # a candidate must be longer than best
        i = s.rfind(tail, lo, hi)  # s[i:i + m] == tail with i + m <= hi: the candidate n = i + m
        while i != -1:
            if text.endswith(s[: i + m]):
                best = i + m
                break
            i = s.rfind(tail, lo, i + m - 1)
        else:
            for n in range(min(m - 1, hi), best, -1):  # the short ones
                if text.endswith(s[:n]):
                    best = n
                    break
    return best
