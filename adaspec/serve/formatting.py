"""OpenAI response and stream-chunk bodies (plain dicts) for completions and chat."""
from __future__ import annotations

import json

from adaspec.outputs import ranked_prompt_logprobs
from adaspec.serve.reasoning import ThinkSplitter
from adaspec.serve.tool_parsers import Parsed, merge_calls
from adaspec.serve.tools import NO_TOOLS

_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


# Characters JSON leaves raw but str.splitlines() breaks lines at (httpx's iter_lines, and other
# clients that split SSE with it): one in generated text cut an event in two (seen in a CI run of
# tests/serve/test_drain.py). SSE ends lines at CR and LF only, so escaping them is for those clients.
_LINE_BREAKING = {"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def sse(obj) -> str:
    """One server-sent event: JSON with unicode kept (ensure_ascii=False), but never a character a
    line-splitting client would break the event at (escaped inside the JSON strings, the only place
    json.dumps puts them: the parsed value is the same)."""
    body = json.dumps(obj, ensure_ascii=False, separators=(',', ':'))
    for ch, escaped in _LINE_BREAKING.items():
        if ch in body:
            body = body.replace(ch, escaped)
    return f"data: {body}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _lp(v: float) -> float:
    return max(float(v), _MIN_LOGPROB)


class LogprobFormatter:
    """Turns the engine's per-token ``{token_id: logprob}`` dicts into OpenAI's shapes."""

    def __init__(self, tokenizer, top_n: int):
        self.tok = tokenizer
        self.top_n = top_n
        self.offset = 0  # completions' text_offset runs across chunks

    def _s(self, tid: int) -> str:
        # no tokenizer (--skip-tokenizer-init): vLLM's "token_id:N" spelling of a token
        return self.tok.decode([tid]) if self.tok is not None else f"token_id:{tid}"

    def _bytes(self, tid: int, text: str) -> list[int]:
        """OpenAI's `bytes`: the token's own (part of a character too, where its text is U+FFFD)."""
        token_bytes = getattr(self.tok, "token_bytes", None)
        return list(token_bytes(tid)) if token_bytes is not None else list(text.encode())

    def _top(self, d: dict[int, float]) -> list[tuple[int, float]]:
        return sorted(d.items(), key=lambda kv: -kv[1])[: self.top_n]

    def _top_and_chosen(self, d: dict[int, float], tid: int) -> list[tuple[int, float]]:
        """The top n and the chosen token: OpenAI's completions "always return the logprob of the
        sampled token, so there may be up to logprobs+1 elements" (vLLM's too; logprobs=0 gives it alone)."""
        top = self._top(d)
        if tid in d and all(t != tid for t, _ in top):
            top.append((tid, d[tid]))
        return top

    def completion(self, ids: list[int], lps: list[dict[int, float] | None]) -> dict:
        """An entry None (an echoed prompt's first token) has null logprobs, as OpenAI's echo."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for tid, d in zip(ids, lps):
            s = self._s(tid)
            out["tokens"].append(s)
            out["token_logprobs"].append(None if d is None else _lp(d.get(tid, _MIN_LOGPROB)))
            out["top_logprobs"].append(None if d is None else {self._s(t): _lp(v) for t, v in self._top_and_chosen(d, tid)})
            out["text_offset"].append(self.offset)
            self.offset += len(s)
        return out

    def chat(self, ids: list[int], lps: list[dict[int, float]]) -> dict:
        content = []
        for tid, d in zip(ids, lps):
            s = self._s(tid)
            content.append({"token": s, "logprob": _lp(d.get(tid, _MIN_LOGPROB)), "bytes": self._bytes(tid, s),
                            "top_logprobs": [{"token": (ts := self._s(t)), "logprob": _lp(v),
                                              "bytes": self._bytes(t, ts)} for t, v in self._top(d)]})
        return {"content": content}


class Formatter:
    """Builds the bodies of one request; ``chat`` picks the chat or the text-completion shape.

    A completions request may carry several prompts, any request n samples of each: each sample is
    a choice with its own ``index`` (serve/generation.py).
    """

    def __init__(self, chat: bool, rid: str, created: int, model: str, tokenizer, top_logprobs: int | None,
                 prompt_logprobs: int | None = None, reading=None):
        self.chat, self.rid, self.created, self.model = chat, rid, created, model
        # a chat request's prepare.ChatReading: how calls and thinking are read out of the text
        self.tools = reading.tools if reading is not None else NO_TOOLS
        self.thinking = reading.thinking if reading is not None else None
        self.chat_echo = reading.echo if reading is not None else None  # before each choice's content
        self._readers: dict = {}  # per streamed choice: its ChoiceReader
        self.tok, self.top = tokenizer, top_logprobs
        self.prompt_top = prompt_logprobs  # vLLM's prompt_logprobs asked for: reported with the choices
        self.echo_without_generation = False  # completions' echo with max_tokens 0 (prepare.Echo)
        self._lp: dict[int, LogprobFormatter] = {}  # per choice: text offsets run across its chunks
        self._prompt_json: dict[int, list] = {}  # per choice: its prompt logprobs, until reported
        self._echoed: set[int] = set()  # choices whose prompt was echoed already

    def echoed(self, index: int) -> bool:
        return index in self._echoed

    def with_prompt(self, g, prompt_lps: tuple | None, text: str, ids: list[int], lps):
        """A choice's prompt part, once: its prompt logprobs ((entries, ranks) from the engine)
        kept for the body as vLLM's prompt_logprobs, and under echo the prompt's text, tokens and
        logprobs before the choice's own. -> (text, ids, lps)."""
        if prompt_lps is not None and self.prompt_top is not None:
            self._prompt_json[g.index] = self._prompt_logprobs_json(g.prompt_ids, *prompt_lps)
        if g.echo_text is None or g.index in self._echoed:
            return text, ids, lps
        self._echoed.add(g.index)
        if lps is not None:
            entries = prompt_lps[0] if prompt_lps is not None else [None] * len(g.prompt_ids)
            ids, lps = list(g.prompt_ids) + list(ids), list(entries) + list(lps)
        return g.echo_text + text, ids, lps

    def _prompt_logprobs_json(self, prompt_ids: list[int], entries: list, ranks: list) -> list:
        """vLLM's prompt_logprobs: per prompt token null (the first) or {token id: {logprob, rank,
        decoded_token}} of the prompt's top n and the prompt token."""
        dec = LogprobFormatter(self.tok, 0)._s
        return [None if r is None else {str(t): {"logprob": _lp(v), "rank": rank, "decoded_token": dec(t)}
                                        for t, v, rank in r}
                for r in ranked_prompt_logprobs(prompt_ids, entries, ranks)]

    def _take_prompt_json(self, index: int, choice: dict) -> None:
        if self.prompt_top is not None and not self.chat and index in self._prompt_json:
            choice["prompt_logprobs"] = self._prompt_json.pop(index)

    @property
    def wants_logprobs(self) -> bool:
        return self.top is not None

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, index: int, ids, lps):
        if self.top is None or lps is None:
            return None
        lp = self._lp.setdefault(index, LogprobFormatter(self.tok, self.top))
        return lp.chat(ids, lps) if self.chat else lp.completion(ids, lps)

    def choice(self, index: int, text: str, ids: list[int], lps, finish: str | None, stop_reason) -> dict:
        choice: dict = {"index": index}
        if self.chat:
            choice["message"], finish = self._message(text, finish)
            if self.chat_echo:
                choice["message"]["content"] = self.chat_echo + (choice["message"]["content"] or "")
        else:
            choice["text"] = text
        choice.update(logprobs=self._logprobs(index, ids, lps), finish_reason=finish, stop_reason=stop_reason)
        self._take_prompt_json(index, choice)
        return choice

    @property
    def _reads_text(self) -> bool:
        return self.tools.reads_calls or self.thinking is not None

    def _reader(self) -> "ChoiceReader":
        return ChoiceReader(self.tools.output_parser() if self.tools.reads_calls else None,
                            ThinkSplitter(self.thinking) if self.thinking is not None else None)

    def _message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """A chat choice's message, and its finish_reason ("tool_calls" once the model called)."""
        if not self._reads_text:
            return {"role": "assistant", "content": text}, finish
        reader = self._reader()
        reasoning, parsed = reader.read(text, final=True)
        calls = merge_calls(parsed.calls)
        message = {"role": "assistant", "content": parsed.content or (None if calls or reasoning else "")}
        if self.thinking is not None:
            message["reasoning"] = reasoning or None
        if calls:
            message["tool_calls"] = calls
        return message, self.tools.finish_reason(finish, bool(calls))

    def _delta(self, index: int, text: str, finish: str | None) -> tuple[dict, str | None]:
        """A chat chunk's delta, and its finish_reason: with tools or a reasoning parser, what the
        choice's reader lets out."""
        if not self._reads_text:
            return ({"content": text} if text or not finish else {}), finish
        reader = self._readers.get(index)
        if reader is None:
            reader = self._readers[index] = self._reader()
        reasoning, parsed = reader.read(text, final=finish is not None)
        if finish is not None:
            finish = self.tools.finish_reason(finish, reader.called)
        delta: dict = {}
        if reasoning:
            delta["reasoning"] = reasoning
        if parsed.content:
            delta["content"] = parsed.content
        if parsed.calls:
            delta["tool_calls"] = [c.to_json() for c in parsed.calls]
        return delta, finish

    def response(self, choices: list[dict], use: dict) -> dict:
        body = self._head("chat.completion" if self.chat else "text_completion")
        body.update(choices=choices, usage=use)
        if self.chat and self.prompt_top is not None:  # vLLM's chat: one prompt, on the response
            body["prompt_logprobs"] = next(iter(self._prompt_json.values()), None)
        return body

    def role_chunk(self, index: int, with_usage: bool, use: dict | None = None) -> dict:
        """A choice's first chunk: its role, and under chat echo the message it continues."""
        body = self._head("chat.completion.chunk")
        body["choices"] = [{"index": index, "delta": {"role": "assistant", "content": self.chat_echo or ""},
                            "logprobs": None, "finish_reason": None}]
        if with_usage:
            body["usage"] = use
        return body

    def chunk(self, index: int, delta: str, ids, lps, finish: str | None, stop_reason, with_usage: bool,
              use: dict | None = None) -> dict | None:
        """None: nothing to send (a tool-call parser holds this text back, and no logprobs came)."""
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        choice: dict = {"index": index}
        if self.chat:
            choice["delta"], finish = self._delta(index, delta, finish)
            if not choice["delta"] and finish is None and not (lps and ids):
                return None
        else:
            choice["text"] = delta
        choice.update(logprobs=self._logprobs(index, ids, lps), finish_reason=finish)
        if finish is not None:
            choice["stop_reason"] = stop_reason
        self._take_prompt_json(index, choice)
        body["choices"] = [choice]
        if with_usage:  # OpenAI: usage null on every chunk but the last; vLLM's continuous stats: so far
            body["usage"] = use
        return body

    def usage_chunk(self, use: dict) -> dict:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body.update(choices=[], usage=use)
        return body


class ChoiceReader:
    """One chat choice's text, in pieces, -> its thinking (serve/reasoning.py), then its content's
    tool calls (serve/tool_parsers.py); either may be absent."""

    def __init__(self, calls, splitter):
        self.calls, self.splitter = calls, splitter

    @property
    def called(self) -> bool:
        return self.calls is not None and self.calls.num_calls > 0

    def read(self, text: str, final: bool) -> tuple[str, Parsed]:
        """-> (reasoning, content and call deltas) this piece makes visible; final: the text ends."""
        reasoning, content = self.splitter.feed(text) if self.splitter is not None else ("", text)
        if final and self.splitter is not None:
            more_reasoning, more_content = self.splitter.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        if self.calls is None:
            return reasoning, Parsed(content=content)
        parsed = self.calls.feed(content)
        return reasoning, parsed + self.calls.finish() if final else parsed
