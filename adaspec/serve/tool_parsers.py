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
- ``PythonicCalls``: "auto" with ``--tool-call-parser pythonic``; a reply that begins with ``[`` is a
  Python list of calls with keyword arguments.

Nothing is dropped but whitespace around calls: text a parser cannot read as a call (a block
that is not a call's JSON, an array cut short by max_tokens) comes back as content.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from adaspec.text_holdback import partial_stop_suffix


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


class Nesting:
    """The bracket depth of code read a character at a time, strings (and their escapes) skipped:
    where an object or a list that began at depth 0 ends."""

    def __init__(self, quotes: str, opens: str, closes: str):
        self.quotes, self.opens, self.closes = quotes, opens, closes
        self.depth, self.quote, self.escaped = 0, "", False

    def closes_with(self, ch: str) -> bool:
        """Read ch; True when it closes the outermost bracket."""
        if self.quote:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == self.quote:
                self.quote = ""
        elif ch in self.quotes:
            self.quote = ch
        elif ch in self.opens:
            self.depth += 1
        elif ch in self.closes:
            self.depth -= 1
            return self.depth == 0
        return False


class JsonCalls(ToolCallParser):
    """Calls as JSON objects {"name": str, ARGUMENT_KEYS[0] (or the next key): object}, one after
    another: OPEN before the first, SEP between two, CLOSE after the last (None: nothing). Each
    object is a call once complete; what cannot be read so (the text cut short by max_tokens, an
    object that is no call) is content at the end, and with no call at all the content is the text
    exactly (as HermesCalls'). ``max_calls``: an object after that many calls is content too. This
    class reads tool_choice "required"'s array.

    The text is read once, character by character (an object's end is found by its brace depth
    outside strings, then it is decoded once): a long argument costs time linear in its length."""

    OPEN: str | None = "["
    SEP = ","
    CLOSE: str | None = "]"
    ARGUMENT_KEYS: tuple[str, ...] = ("parameters",)

    def __init__(self, max_calls: int | None = None):
        super().__init__()
        self.max_calls = max_calls
        self.expect = "open" if self.OPEN else "object"  # then "object", "separator", "end" or "bad"
        self.obj: list[str] = []  # the object being read
        self.nesting = Nesting('"', "{[", "}]")
        self.rest: list[str] = []  # after a wrong turn: everything from the object or mark that was wrong
        self.before_calls: list[str] = []  # the text fed while no call was read: the content if none is

    def feed(self, text: str) -> Parsed:
        if self.num_calls == 0:
            self.before_calls.append(text)
        calls = []
        for i, ch in enumerate(text):
            if self.expect in ("end", "bad"):
                if self.expect == "bad":
                    self.rest.append(text[i:])
                break
            if self.obj:
                self.obj.append(ch)
                if self.nesting.closes_with(ch):
                    call = self._call("".join(self.obj))
                    if call is None:
                        self.expect = "bad"
                        self.rest.append("".join(self.obj))
                    else:
                        calls.append(call)
                        self.expect = "separator"
                    self.obj = []
                continue
            if ch.isspace():
                continue
            if self.expect == "object" and ch == "{":
                self.obj, self.nesting = [ch], Nesting('"', "{[", "}]")
                self.nesting.closes_with(ch)
            elif self.expect == "open" and ch == self.OPEN:
                self.expect = "object"
            elif self.expect == "separator" and ch == self.SEP:
                self.expect = "object"
            elif self.expect == "separator" and ch == self.CLOSE:
                self.expect = "end"
            else:
                self.expect = "bad"
                self.rest.append(text[i:])
                break
        return Parsed(calls=calls)

    def _call(self, text: str) -> CallDelta | None:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        if self.max_calls is not None and self.num_calls >= self.max_calls:
            return None
        args = arguments_text(next((value[k] for k in self.ARGUMENT_KEYS if k in value), None))
        return None if args is None else self._new_call(value["name"], args)

    def finish(self) -> Parsed:
        if self.num_calls == 0:
            return Parsed(content="".join(self.before_calls))
        rest = "".join(self.obj) + "".join(self.rest)
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
        self.head = ""  # the reply's start, until it says

    def feed(self, text: str) -> Parsed:
        if self.mode == "text":
            return Parsed(content=text)
        if self.mode == "calls":
            return super().feed(text)
        self.head += text
        start = self.head.lstrip()
        if start.startswith(self.TAG) or start.startswith("{"):
            self.mode = "calls"
            return super().feed(start[len(self.TAG):] if start.startswith(self.TAG) else start)
        if not start or self.TAG.startswith(start):
            return Parsed()  # whitespace, or the tag arriving
        self.mode = "text"
        return Parsed(content=self.head)

    def finish(self) -> Parsed:
        if self.mode is None:  # nothing but whitespace or a piece of the tag
            return Parsed(content=self.head)
        if self.mode == "calls" and self.num_calls == 0:  # the text exactly: the head held what the
            return Parsed(content=self.head + "".join(self.before_calls[1:]))  # first feed got less of
        return Parsed() if self.mode == "text" else super().finish()


class HermesCalls(ToolCallParser):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks in free text (Hermes,
    Qwen2.5 and adaspec's own chat template). Text before, between and after the calls is content,
    but not the whitespace around the calls at its start and end; a block that is not a call's JSON
    is content as written; a block the text ends inside is a call if its JSON is whole. With no call
    at all, the content is the text exactly. ``max_calls``: blocks after that many calls are content (parallel_tool_calls
    false)."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, max_calls: int | None = None):
        super().__init__()
        self.max_calls = max_calls
        self.pending = ""  # content not given out yet: what may start a block, or whitespace before one
        self.in_block = False
        self.body: list[str] = []  # the open block's text so far (in pieces: a long one is not copied per piece)
        self.tail = ""  # its last characters, where a closing tag may have begun
        self.gap = ""  # the whitespace before the open block: content unless the block is a call
        self.after_call = False  # the whitespace that follows a call is not content either...
        self.said = False  # ...unless content came before it

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        while True:
            if self.in_block:
                closed, text = self._read_block(text)
                if closed is None:
                    return out
                out += closed
            self.pending += text
            start = self.pending.find(self.START)
            if start >= 0:
                before = self.pending[:start]
                words = before.rstrip()
                out.content += self._content(words)
                self.gap = before[len(words):]
                text, self.pending, self.in_block = self.pending[start + len(self.START):], "", True
                continue
            # what may yet be the start of a block, or whitespace before one, waits
            held = partial_stop_suffix(self.pending, (self.START,))
            visible = self.pending[:len(self.pending) - held].rstrip()
            out.content += self._content(visible)
            self.pending = self.pending[len(visible):]
            return out

    def _read_block(self, text: str) -> tuple[Parsed | None, str]:
        """More of the open block -> (what it made once closed, or None while open; the text after it)."""
        window = self.tail + text
        at = window.find(self.END)
        if at < 0:
            self.body.append(text)
            self.tail = window[-(len(self.END) - 1):]
            return None, ""
        body = "".join(self.body) + text
        cut = len(body) - len(window) + at  # where the closing tag begins
        self.in_block, self.body, self.tail = False, [], ""
        return self._block(body[:cut], closed=True), body[cut + len(self.END):]

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
            return self._block("".join(self.body), closed=False)
        if self.num_calls == 0:
            return Parsed(content=rest)
        return Parsed(content=self._content(rest.rstrip()))


class PythonicCalls(ToolCallParser):
    """Llama 3.2 / 4's pythonic calls (``--tool-call-parser pythonic``): a reply that begins with "["
    is a Python list of calls, ``[get_weather(city="Paris"), get_time()]``, keyword arguments of
    literal values (JSON's true / false / null read too). The list is read once its closing bracket
    comes (its text held back until then); one that is not such a list is content as written, and
    so is what follows it; any other reply is content, exactly, held back only until its first
    character tells."""

    def __init__(self, max_calls: int | None = None):
        super().__init__()
        self.max_calls = max_calls
        self.mode: str | None = None  # "list" while the list is read, then "text"
        self.parts: list[str] = []  # the list so far (or what came before the first character)
        self.nesting = Nesting("'\"", "([{", ")]}")

    def feed(self, text: str) -> Parsed:
        if self.mode == "text":
            return Parsed(content=text)
        if self.mode is None:
            head = ("".join(self.parts) + text).lstrip()
            if not head:
                self.parts.append(text)
                return Parsed()
            if head[0] != "[":
                self.mode, held, self.parts = "text", "".join(self.parts) + text, []
                return Parsed(content=held)
            self.mode, self.parts, text = "list", [], head
        for i, ch in enumerate(text):
            if self.nesting.closes_with(ch):
                self.parts.append(text[:i + 1])
                self.mode = "text"
                return self._list("".join(self.parts)) + Parsed(content=text[i + 1:])
        self.parts.append(text)
        return Parsed()

    def _list(self, source: str) -> Parsed:
        calls = _pythonic_calls(source)
        if calls is None:
            return Parsed(content=source)
        keep = calls if self.max_calls is None else calls[:self.max_calls]
        out = Parsed(calls=[self._new_call(name, json.dumps(args, ensure_ascii=False)) for name, args, _ in keep])
        if len(keep) < len(calls):  # past max_calls: the calls' own text is content
            out.content = "[" + ", ".join(text for _, _, text in calls[len(keep):]) + "]"
        return out

    def finish(self) -> Parsed:
        rest = "".join(self.parts)  # a list the reply ended inside, or only whitespace
        self.parts = []
        return Parsed(content=rest) if self.mode != "text" else Parsed()


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _pythonic_calls(source: str) -> list[tuple[str, dict, str]] | None:
    """[f(a=1), g()] -> [("f", {"a": 1}, "f(a=1)"), ("g", {}, "g()")]; None when it is not a list of
    such calls."""
    import ast

    source = source.strip()
    try:
        tree = ast.parse(source, mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for call in tree.elts:
        if not isinstance(call, ast.Call) or call.args or not isinstance(call.func, (ast.Name, ast.Attribute)):
            return None
        try:
            args = {kw.arg: _literal(kw.value) for kw in call.keywords if kw.arg is not None}
        except ValueError:
            return None
        if len(args) != len(call.keywords):  # a **mapping
            return None
        calls.append((ast.unparse(call.func), args, ast.get_source_segment(source, call)))
    return calls


def _literal(node):
    import ast

    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("a ** in a literal")
        return {ast.literal_eval(k): _literal(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)  # ValueError on anything that is not a literal


TOOL_CALL_PARSERS = {"hermes": HermesCalls, "llama3_json": Llama3JsonCalls, "pythonic": PythonicCalls}
