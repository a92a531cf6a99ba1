"""Reasoning models' thinking, read out of a chat choice's text (``--reasoning-parser``, vLLM's).

Qwen3 and DeepSeek-R1 think between ``<think>`` and ``</think>``: the text between goes to the
message's ``reasoning`` field (vLLM's name; its older ``reasoning_content`` is gone from vLLM too),
the text after ``</think>`` is the ``content``. Where the output starts is read off the prompt: a
prompt whose last ``<think>`` is still open (DeepSeek-R1's and Qwen3.5's templates open it) starts
the output in reasoning; one whose thinking is closed (Qwen3 with ``enable_thinking: false`` writes
an empty ``<think></think>``), or that never opened it, starts in content, unless the output itself
begins with ``<think>``. An output cut short inside its thinking is all reasoning. The tags are
dropped, nothing else: whitespace stays as generated. Like the tool-call parsers, one splitter
reads a streamed and a whole text alike.
"""
from __future__ import annotations

from adaspec.reasoning_tags import REASONING_TAGS
from adaspec.text_holdback import partial_stop_suffix

START, END = REASONING_TAGS["qwen3"]
REASONING_PARSERS = tuple(REASONING_TAGS)  # all of them think in <think> ... </think>


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether the prompt leaves a <think> open, so that the output starts inside it."""
    return prompt_text.rfind(START) > prompt_text.rfind(END)


class ThinkSplitter:
    def __init__(self, in_reasoning: bool):
        self.state = "reasoning" if in_reasoning else "start"  # then "reasoning" or "content"
        self.pending = ""  # text held back: what may still be a tag

    def feed(self, text: str) -> tuple[str, str]:
        """-> (reasoning, content) this piece makes visible."""
        if self.state == "content":
            return "", text
        self.pending += text
        reasoning = ""
        if self.state == "start":
            head = self.pending.lstrip()
            if head.startswith(START):
                self.state, self.pending = "reasoning", head[len(START):]
            elif not head or START.startswith(head):
                return "", ""  # whitespace, or the tag arriving
            else:
                self.state, held, self.pending = "content", self.pending, ""
                return "", held
        end = self.pending.find(END)
        if end >= 0:
            reasoning, content = self.pending[:end], self.pending[end + len(END):]
            self.state, self.pending = "content", ""
            return reasoning, content
        held = partial_stop_suffix(self.pending, (END,))
        reasoning, self.pending = self.pending[:len(self.pending) - held], self.pending[len(self.pending) - held:]
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        rest, self.pending = self.pending, ""
        if self.state == "start":  # only whitespace, or a piece of the tag: content
            return "", rest
        return rest, ""  # cut short while thinking (content has no pending text)
