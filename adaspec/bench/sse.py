"""Incremental parser for server-sent events as OpenAI streams them (`data: {...}` events)."""
from __future__ import annotations


class SSEParser:
    """Feed raw bytes as they arrive; get back the `data` payload of every complete event.

    Bytes can split anywhere (inside a line, inside a UTF-8 character), so text is only decoded
    once an event is complete. Comment lines (`: ping`) and other fields are ignored.
    """

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[str]:
        self._buf += data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        events: list[str] = []
        while True:
            end = self._buf.find(b"\n\n")
            if end < 0:
                break
            raw, self._buf = self._buf[:end], self._buf[end + 2 :]
            payload = _data_of(raw.decode("utf-8", errors="replace"))
            if payload is not None:
                events.append(payload)
        return events

    def close(self) -> list[str]:
        """An event the server ended without its blank line still counts (some servers do that)."""
        rest, self._buf = self._buf, b""
        payload = _data_of(rest.decode("utf-8", errors="replace")) if rest.strip() else None
        return [payload] if payload is not None else []


def _data_of(event: str) -> str | None:
    lines = []
    for line in event.split("\n"):
        if line.startswith("data:"):
            value = line[5:]
            lines.append(value[1:] if value.startswith(" ") else value)
    return "\n".join(lines) if lines else None
