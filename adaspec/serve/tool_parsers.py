"""Reading tool calls out of a chat choice's text, as it streams.

Each parser takes the text in pieces (``feed``) and once more at the end (``finish``), and
returns what each piece makes visible: content text, and tool-call deltas in OpenAI's streaming
shape (a call's first delta carries its id and name, later ones more of its arguments). A
non-streamed response feeds the whole text at once, so both paths give the same message by
construction, whatever the split (tests/serve/test_tool_parsers.py checks every split).

- ``NamedCall``: tool_choice named one function; the text is its arguments (structured outputs
  held it to the function's schema).
- ``JsonCalls``: tool_choice "required"; the text is a JSON array of {"name", "parameters"}
  objects (held to that shape); each element becomes a call once it is complete.
- ``HermesCalls``: tool_choice "auto" with ``--tool-call-parser hermes``; calls are
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in free text.
- ``Llama3JsonCalls``: "auto" with ``--tool-call-parser llama3_json``; a reply that begins with
  ``<|python_tag|>`` or ``{`` is ``{"name": ..., "parameters": {...}}`` objects separated by ``;``.

Nothing is dropped but whitespace around calls: text a parser cannot read as a call (a block
that is not a call's JSON, an array cut short by max_tokens) comes back as content.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"  # vLLM's spelling


@dataclass
class CallDelta:
    """Part of one call: its first part has its id and name; every part adds to its arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_json(self) -> dict:
        out: dict = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function", function={"name": self.name, "arguments": self.arguments})
        else:
            out["function"] = {"arguments": self.arguments}
        return out


@dataclass
class Parsed:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __add__(self, other: "Parsed") -> "Parsed":
        return Parsed(self.content + other.content, self.calls + other.calls)


def merge_calls(deltas: list[CallDelta]) -> list[dict]:
    """Deltas -> whole calls, OpenAI's message.tool_calls."""
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.id is not None:
            calls[d.index] = {"id": d.id, "type": "function", "function": {"name": d.name, "arguments": d.arguments}}
        else:
            calls[d.index]["function"]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]


class ToolCallParser:
    """Reads the calls out of one choice's text: ``feed`` each piece, then ``finish`` once."""

    def __init__(self) -> None:
        self.num_calls = 0

    def _new_call(self, name: str, arguments: str) -> CallDelta:
        self.num_calls += 1
        return CallDelta(self.num_calls - 1, arguments, new_call_id(), name)

    def feed(self, text: str) -> Parsed:
        raise NotImplementedError

    def finish(self) -> Parsed:
        raise NotImplementedError


class NamedCall(ToolCallParser):
    """One call to ``name``: its arguments stream as the text does (even when cut short by
    max_tokens, as vLLM: finish_reason "length" says so)."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def feed(self, text: str) -> Parsed:
        if not text:
            return Parsed()
        if self.num_calls == 0:
            return Parsed(calls=[self._new_call(self.name, text)])
        return Parsed(calls=[CallDelta(0, text)])

    def finish(self) -> Parsed:
        return Parsed(calls=[self._new_call(self.name, "")]) if self.num_calls == 0 else Parsed()


def arguments_text(value) -> str | None:
    """A call's arguments as OpenAI sends them: a JSON object's text (None: not an object)."""
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


class JsonCalls(ToolCallParser):
    """Calls as JSON objects {"name": str, ARGUMENT_KEYS[0] (or the next key): object}, one after
    another: OPEN before the first, SEP between two, CLOSE after the last (None: nothing). Each
    object is a call once complete; what cannot be read so (the text cut short by max_tokens, an
    object that is no call) is content at the end. ``max_calls``: an object after that many calls
    is content too. This class reads tool_choice "required"'s array."""

    OPEN: str | None = "["
    SEP = ","
    CLOSE: str | None = "]"
    ARGUMENT_KEYS: tuple[str, ...] = ("parameters",)
    _decoder = json.JSONDecoder()

    def __init__(self, max_calls: int | None = None):
        super().__init__()
        self.max_calls = max_calls
        self.text = ""
        self.pos = 0  # where reading resumes
        self.expect = "open" if self.OPEN else "object"  # then "object", "separator", "end" or "bad"
        self.tried = 0  # the text's length when an object last failed to decode: retried after a "}"

    def feed(self, text: str) -> Parsed:
        self.text += text
        return Parsed(calls=self._read())

    def _read(self) -> list[CallDelta]:
        calls = []
        while self.expect not in ("end", "bad"):
            while self.pos < len(self.text) and self.text[self.pos].isspace():
                self.pos += 1
            if self.pos == len(self.text):
                break
            ch = self.text[self.pos]
            if self.expect == "open":
                self._expect(ch == self.OPEN, "object")
            elif self.expect == "separator":
                self._expect(ch == self.SEP or ch == self.CLOSE, "object" if ch == self.SEP else "end")
            else:  # an object is complete only once a closing brace has come
                if "}" not in self.text[self.tried:]:
                    break
                try:
                    value, end = self._decoder.raw_decode(self.text, self.pos)
                except json.JSONDecodeError:
                    self.tried = len(self.text)
                    break
                call = self._call(value)
                if call is None:
                    self.expect = "bad"
                    break
                calls.append(call)
                self.pos, self.expect = end, "separator"
        return calls

    def _expect(self, ok: bool, then: str) -> None:
        if ok:
            self.pos += 1
            self.expect = then
        else:
            self.expect = "bad"

    def _call(self, value) -> CallDelta | None:
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        if self.max_calls is not None and self.num_calls >= self.max_calls:
            return None
        args = arguments_text(next((value[k] for k in self.ARGUMENT_KEYS if k in value), None))
        return None if args is None else self._new_call(value["name"], args)

    def finish(self) -> Parsed:
        rest = self.text[self.pos:]
        return Parsed(content=rest if rest.strip() else "")


class Llama3JsonCalls(JsonCalls):
    """Llama 3.1 / 3.2's JSON tool calls (``--tool-call-parser llama3_json``): a reply that begins
    with <|python_tag|> or "{" is calls, {"name": ..., "parameters": {...}} separated by ";"
    ("arguments" is read too); any other reply is content, exactly. The text is held back only
    until its first characters tell which."""

    OPEN, SEP, CLOSE = None, ";", None
    ARGUMENT_KEYS = ("parameters", "arguments")
    TAG = "<|python_tag|>"

    def __init__(self, max_calls: int | None = None):
        super().__init__(max_calls)
        self.mode: str | None = None  # "calls" or "text" once the reply's start says

    def feed(self, text: str) -> Parsed:
        if self.mode == "text":
            return Parsed(content=text)
        self.text += text
        if self.mode is None:
            head = self.text.lstrip()
            if head.startswith(self.TAG) or head.startswith("{"):
                self.mode = "calls"
                if head.startswith(self.TAG):
                    self.pos = len(self.text) - len(head) + len(self.TAG)
            elif not head or self.TAG.startswith(head):
                return Parsed()  # whitespace, or the tag arriving
            else:
                self.mode, held, self.text = "text", self.text, ""
                return Parsed(content=held)
        return Parsed(calls=self._read())

    def finish(self) -> Parsed:
        if self.mode is None:  # nothing but whitespace or a piece of the tag
            return Parsed(content=self.text)
        return Parsed() if self.mode == "text" else super().finish()


class HermesCalls(ToolCallParser):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks in free text (Hermes,
    Qwen2.5 and adaspec's own chat template). Text before, between and after the calls is content,
    but not the whitespace around the calls at its start and end; a block that is not a call's JSON is content as written;
    a block the text ends inside is a call if its JSON is whole. With no call at all, the content is
    the text exactly. ``max_calls``: blocks after that many calls are content (parallel_tool_calls
    false)."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, max_calls: int | None = None):
        super().__init__()
        self.max_calls = max_calls
        self.pending = ""  # text not given out yet: content held back, or a block's body
        self.in_block = False
        self.gap = ""  # the whitespace before the open block: content unless the block is a call
        self.after_call = False  # the whitespace that follows a call is not content either...
        self.said = False  # ...unless content came before it

    def feed(self, text: str) -> Parsed:
        self.pending += text
        out = Parsed()
        while True:
            if self.in_block:
                end = self.pending.find(self.END)
                if end < 0:
                    return out
                out += self._block(self.pending[:end], closed=True)
                self.pending, self.in_block = self.pending[end + len(self.END):], False
                continue
            start = self.pending.find(self.START)
            if start >= 0:
                before = self.pending[:start]
                words = before.rstrip()
                out.content += self._content(words)
                self.gap = before[len(words):]
                self.pending, self.in_block = self.pending[start + len(self.START):], True
                continue
            # what may yet be the start of a block, or whitespace before one, waits
            held = partial_suffix(self.pending, self.START)
            visible = self.pending[:len(self.pending) - held].rstrip()
            out.content += self._content(visible)
            self.pending = self.pending[len(visible):]
            return out

    def _content(self, words: str) -> str:
        """words: text ending in a non-space (or empty). The whitespace after a call goes unless
        content came before the call (then it parts the two)."""
        if self.after_call and words:
            if not self.said:
                words = words.lstrip()
            self.after_call = False
        self.said = self.said or bool(words)
        return words

    def _block(self, body: str, closed: bool) -> Parsed:
        gap, self.gap = self.gap, ""
        call = None
        if self.max_calls is None or self.num_calls < self.max_calls:
            try:
                value = json.loads(body)
            except json.JSONDecodeError:
                value = None
            name = value.get("name") if isinstance(value, dict) else None
            args = arguments_text(value.get("arguments", {})) if isinstance(value, dict) else None
            if isinstance(name, str) and args is not None:
                call = self._new_call(name, args)
        if call is None:
            return Parsed(content=self._content(gap + self.START + body + (self.END if closed else "")))
        self.after_call = True
        return Parsed(calls=[call])

    def finish(self) -> Parsed:
        rest, self.pending = self.pending, ""
        if self.in_block:
            self.in_block = False
            return self._block(rest, closed=False)
        if self.num_calls == 0:
            return Parsed(content=rest)
        return Parsed(content=self._content(rest.rstrip()))


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (the tag may be arriving)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


TOOL_CALL_PARSERS = {"hermes": HermesCalls, "llama3_json": Llama3JsonCalls}
