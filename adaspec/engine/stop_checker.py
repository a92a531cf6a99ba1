"""Appending sampled tokens to a request: stop conditions and the text clients may see.

Tokens are appended ONE AT A TIME and every stop condition is checked after each, so a
step that emits several tokens (speculative decoding) ends a request exactly where a
one-token-per-step run would have: tokens after the stop are dropped.
"""
from __future__ import annotations

from adaspec.engine.sequence import Sequence
from adaspec.models.tokenizer import Tokenizer
from adaspec.sampling_params import RequestOutputKind
from adaspec.text_holdback import partial_stop_suffix


class StopChecker:
    def __init__(self, tokenizer: Tokenizer | None, max_model_len: int, eos_token_ids: set[int] | None = None):
        self.tokenizer = tokenizer  # None: skip_tokenizer_init, no text (stop strings are refused earlier)
        self.max_model_len = max_model_len
        self.eos_token_ids = tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids

    def append(self, seq: Sequence, tokens: list[int], logprobs: list[dict[int, float]] | None = None) -> int:
        """Append tokens until one ends the request. Returns how many were appended."""
        plain = seq.appends_without_text
        if plain is None:  # decided once: it depends on the request's parameters and this engine only
            plain = seq.appends_without_text = (not seq.params.stop and seq.logprobs is None
                                                and self._stream(seq) is None)
            if plain:  # the tokens that end it on that path, likewise
                seq.stop_ids = frozenset(seq.params.stop_token_ids).union(
                    () if seq.params.ignore_eos else self.eos_token_ids)
        if plain:
            return self._append_without_text(seq, tokens)
        return self._append_each(seq, tokens, logprobs)

    def _append_each(self, seq: Sequence, tokens: list[int], logprobs: list[dict[int, float]] | None) -> int:
        """append(), token by token: every condition checked after each token."""
        p = seq.params
        appended = 0
        text_set = False  # a stop string already cut the text
        stream = self._stream(seq)
        for i, tok in enumerate(tokens):
            seq.token_ids.append(tok)
            if stream is not None:
                stream.step(tok)
            if seq.logprobs is not None and logprobs is not None:
                seq.logprobs.append(logprobs[i])
            appended += 1
            if not p.ignore_eos and tok in self.eos_token_ids:
                self._finish(seq, "stop", None)  # as vLLM: an end of sequence is no stop_reason
            elif tok in p.stop_token_ids:
                self._finish(seq, "stop", tok)
            elif p.stop and seq.num_output_tokens > (p.min_tokens or 0) and self._hit_stop_string(seq):
                text_set = True
            elif p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
                self._finish(seq, "length", None)
            elif len(seq.token_ids) >= self.max_model_len:
                self._finish(seq, "length", None)
            if seq.finish_reason is not None:
                break
            if p.stop and seq.num_output_tokens == p.min_tokens:  # (vLLM's stop-string window: below)
                seq.min_tokens_text_len = len(self._decode(seq))
        if not text_set and self._wants_text(seq) and not self._text_at_finish_only(seq):
            self._update_text(seq)
        return appended

    def _append_without_text(self, seq: Sequence, tokens: list[int]) -> int:
        """append() for a request without stop strings, logprobs or a text stream: the same checks
        in the same order per token (end-of-sequence, stop tokens, then max_tokens, then
        max_model_len), found for the whole list at once instead of token by token (the per-token
        loop was ~15% of the host's work in a speculative step at 256 requests)."""
        # how many it appends before a length limit ends the request (at least the first: a token
        # is always appended before the limits are checked); min and max avoided (a hot loop)
        limit = seq.max_len if seq.max_len < self.max_model_len else self.max_model_len
        n = limit - len(seq.token_ids)
        reason, stop_tok = "length", None
        if n < 1:
            n = 1
        if n > len(tokens):
            n, reason = len(tokens), None
        stops = seq.stop_ids  # end-of-sequence (unless ignored) and the stop tokens
        if stops and not stops.isdisjoint(tokens[:n]):  # a stop token at or before the length limit wins
            for i in range(n):
                if tokens[i] in stops:  # an end of sequence first, as the token-by-token path checks
                    eos = not seq.params.ignore_eos and tokens[i] in self.eos_token_ids
                    n, reason, stop_tok = i + 1, "stop", None if eos else tokens[i]
                    break
        seq.token_ids.extend(tokens[:n])
        # such a request has no text stream and no stop strings: its text, if kept at all, is only
        # read once it ends (final-only outputs), so it is decoded once, then
        if reason is not None:
            self._finish(seq, reason, stop_tok)
            if self._wants_text(seq):
                self._update_text(seq)
        return n

    def _wants_text(self, seq: Sequence) -> bool:
        """Whether the engine keeps the request's text: not without a tokenizer, nor for
        detokenize=False (the server's API processes decode those themselves: the text was 24-39%
        of the engine's host work per speculative step at 256 streamed requests on CPU)."""
        return self.tokenizer is not None and seq.params.detokenize

    @staticmethod
    def _text_at_finish_only(seq: Sequence) -> bool:
        """A running request that reports only its final output and has no stop strings: nobody
        reads its text before it ends, so it is decoded once then (finish_text), not token by token
        (incremental detokenization was half the host time of a speculative step at 256 requests)."""
        p = seq.params
        return p.output_kind is RequestOutputKind.FINAL_ONLY and not p.stop and seq.finish_reason is None

    def finish_text(self, seq: Sequence) -> None:
        """The whole output's text, for a request that ends without a stop check (an abort)."""
        if self._wants_text(seq) and self._text_at_finish_only(seq):
            seq.output_text = self._decode(seq)

    def _stream(self, seq: Sequence):
        """The request's incremental detokenizer, or None where the text is decoded whole: stop
        strings (their window logic works on the full text), final-only outputs, no tokenizer."""
        if not self._wants_text(seq) or seq.params.stop or seq.params.output_kind is RequestOutputKind.FINAL_ONLY:
            return None
        stream = getattr(seq, "text_stream", None)
        if stream is None:
            stream = seq.text_stream = self.tokenizer.decode_stream(seq.params.skip_special_tokens)
            for tok in seq.output_token_ids:  # tokens appended before the stream existed
                stream.step(tok)
        return stream

    def _decode(self, seq: Sequence) -> str:
        ids = seq.output_token_ids
        if stopped_by_token(seq.finish_reason, seq.stop_reason) and not seq.params.include_stop_str_in_output:
            ids = ids[:-1]  # as vLLM: the token that stopped it is no part of the text (with skip_special_tokens off too)
        return self.tokenizer.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)

    def _hit_stop_string(self, seq: Sequence) -> bool:
        text = self._decode(seq)
        # only the tail can hold a new match: the last token added at most its own length
        window_start = max(0, len(seq.output_text) - max(len(s) for s in seq.params.stop))
        held = seq.min_tokens_text_len  # min_tokens: the length of its first tokens' text
        for s in seq.params.stop:
            # a match must end after the min_tokens-th token's text (vLLM: nothing within it stops)
            at = text.find(s, max(window_start, held - len(s) + 1))
            if at != -1:
                end = at + len(s) if seq.params.include_stop_str_in_output else at
                seq.output_text = text[:end]
                self._finish(seq, "stop", s)
                return True
        return False

    def _update_text(self, seq: Sequence) -> None:
        stream = getattr(seq, "text_stream", None)
        if stream is not None and seq.finish_reason is None:
            seq.output_text = stream.text  # complete characters only, and it never shrinks
            return
        # a finished request (or one with stop strings) gets the whole output decoded once
        text = self._decode(seq)
        if seq.finish_reason is None:
            # hold back an unfinished UTF-8 sequence, then what may still turn into a stop string
            # (in that order: a tail that ends in half a character matches no stop string's start)
            stable = text.rstrip("\ufffd")
            stable = stable[: len(stable) - partial_stop_suffix(stable, seq.params.stop)] if seq.params.stop else stable
            if len(stable) >= len(seq.output_text):
                seq.output_text = stable
        else:
            seq.output_text = text

    @staticmethod
    def _finish(seq: Sequence, reason: str, stop_reason) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason


def stopped_by_token(finish_reason: str | None, stop_reason) -> bool:
    """Whether a request ended on an end-of-sequence (stop_reason None) or stop token (its id), its
    last token, rather than on a stop string."""
    return finish_reason == "stop" and not isinstance(stop_reason, str)
