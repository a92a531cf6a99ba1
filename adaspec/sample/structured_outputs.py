"""Structured outputs: the output follows a JSON schema, a regular expression, one of a list of
strings, or a Lark/GBNF grammar (SamplingParams.structured_outputs, vLLM's names).

llguidance compiles the constraint against the model's tokenizer when the engine adds the request
(a bad schema or grammar fails that request alone, with llguidance's message), and each request
keeps a matcher that has consumed its output so far (GrammarState, brought up to date lazily, as
the penalties' counts are). At every sampling row the matcher's mask of allowed next tokens sets
the other logits to -inf before any other rule (vLLM applies its grammar bitmask first too).

Speculative decoding stays lossless: a verification position's mask is the one its history (the
output plus the drafts before it) would have, so the target's distribution there is exactly the
constrained one; a draft the grammar refuses has target probability 0 and is rejected, so the
positions after it are never read (their masks are left all-allowed). llguidance computes one
request's positions in one call that consumes the drafts and rolls them back
(LLExecutor.unsafe_compute_mask_ptr_with_draft_token), for all requests in parallel threads.

A grammar needs the request's last token on the host: the engine reads a step in flight back
before it schedules a request with a grammar (llm_engine: _read_back_for_grammars), so such
requests run without async scheduling's overlap.
"""
from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from adaspec.errors import InvalidRequestError
from adaspec.h2d import to_device

_PARAM = "structured_outputs"
_tokenizers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # engine tokenizer -> {(V, eos): LLTokenizer}
_pools: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # engine tokenizer -> {(V, eos): {text: pool}}
# re-entrant: a request's state given back by the collector may run its finalizer on a thread that
# holds the lock already
_pools_lock = threading.RLock()
# compiled grammars kept per tokenizer: requests that share a schema (the same tools, the same
# response_format) reuse matchers compiled for earlier ones. Compiling costs 1 ms (a regex) to 5 ms
# (20 tools' "required" array) at a 152k vocabulary (BENCHMARKS.md), on the engine's loop when a
# request is added
MAX_COMPILED_PER_TOKENIZER = 128  # grammar texts
# matchers of finished requests kept for the next ones, over all grammars and tokenizers: about
# the most requests with structured outputs that run at once (2,048 in the lossless tests, whose
# waves compiled 5x more matchers with room for 256)
MAX_FREE_MATCHERS = 2048
_executor = None


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # a dependency of adaspec's; named, should an install lack it
        raise InvalidRequestError(f"structured_outputs need the llguidance package ({e})", param=_PARAM) from None
    return llguidance


def grammar_tokenizer(tokenizer, vocab_size: int, eos_token_ids) -> object:
    """llguidance's view of the engine's tokenizer (made once per tokenizer, vocabulary size and
    end-of-sequence ids: ~30 ms for an 8k vocabulary, more for 150k). Token ids the tokenizer
    does not have (a padded embedding) are never allowed; the grammar's end allows exactly the
    engine's end-of-sequence ids."""
    eos = tuple(sorted(eos_token_ids))
    cache = _tokenizers.setdefault(tokenizer, {})
    key = (vocab_size, eos)
    if key not in cache:
        # (a model may have fewer logits than the tokenizer has tokens, e.g. the statistical tests'
        # micro models; llguidance needs them all: the masks are cut to the logits' width)
        n_vocab = max(vocab_size, len(tokenizer))
        cache[key] = _llguidance().LLTokenizer(tokenizer.backend_json(), n_vocab=n_vocab, eos_token=list(eos))
    return cache[key]


def _no_additional_properties(schema):
    """The schema with additionalProperties: false on every object that does not say otherwise
    (vLLM's disable_additional_properties)."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def grammar_text(params) -> str:
    """The llguidance grammar (its JSON form) of a StructuredOutputsParams. Raises
    InvalidRequestError for a JSON schema that is not JSON."""
    ll = _llguidance()
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.json if kind == "json" else {"type": "object"}
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"structured_outputs.json is not valid JSON: {e}", param=_PARAM) from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(f"structured_outputs.json must be a JSON schema object, got "
                                      f"{type(schema).__name__}", param=_PARAM)
        if params.disable_additional_properties:
            schema = _no_additional_properties(schema)
        try:
            return ll.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": not params.disable_any_whitespace})
        except ValueError as e:
            raise InvalidRequestError(f"structured_outputs.json: {e}", param=_PARAM) from None
    if kind == "regex":
        return ll.grammar_from("regex", params.regex)
    if kind == "choice":
        return ll.grammar_from("choice", list(params.choice))
    try:  # Lark, or GBNF (llama.cpp's) converted to Lark
        return ll.grammar_from("grammar", params.grammar)
    except ValueError as e:
        raise InvalidRequestError(f"structured_outputs.grammar: {e}", param=_PARAM) from None


def _free_matchers() -> int:
    """The matchers all pools keep (under _pools_lock; at most 128 grammars per tokenizer)."""
    return sum(pool.num_free for by_vocab in _pools.values() for pools in by_vocab.values()
               for pool in pools.values())


class MatcherPool:
    """Matchers of one grammar, each compiled on its own, lent to requests (GrammarState) and taken
    back reset when a request's state is dropped, for the next request with that grammar.

    Why not copies of one compiled matcher (LLMatcher.deep_copy): llguidance's copies share the
    original's lexer behind a mutex that a mask's computation holds, so the executor's threads
    computed the masks of requests with the same grammar one at a time (H100 run 47: 64 requests of
    one regex, 418 ms of llguidance per 64 steps with copies of one matcher against 61 ms with one
    compile per request). Here every live request's matcher has a lexer of its own, and a returned
    one keeps its lexer's warm cache for the next request."""

    def __init__(self, ll_tok, text: str, first):
        self.ll_tok, self.text = ll_tok, text
        self._free = []
        self.give_back(first)

    def take(self):
        """A matcher in its initial state that no one else holds."""
        with _pools_lock:
            if self._free:
                return self._free.pop()
        return _llguidance().LLMatcher(self.ll_tok, self.text, log_level=0)

    def give_back(self, matcher) -> None:
        """A request's matcher, once the request is done with it (kept if it resets cleanly and
        all pools hold fewer than MAX_FREE_MATCHERS)."""
        if matcher.reset() and not matcher.is_error():
            with _pools_lock:
                if _free_matchers() < MAX_FREE_MATCHERS:
                    self._free.append(matcher)

    @property
    def num_free(self) -> int:
        return len(self._free)


@dataclass(frozen=True)
class Grammar:
    """A request's compiled constraint: llguidance's grammar, the tokenizer it was checked with,
    and the pool of matchers compiled for it (shared by the requests with the same grammar)."""

    text: str
    tokenizer: object = field(compare=False, repr=False)
    pool: MatcherPool = field(compare=False, repr=False, default=None)
    # a thinking model's end-of-thinking token (--reasoning-parser): the grammar holds the output only
    # after it, as vLLM's structured outputs wait for the end of the reasoning; None: from the start
    starts_after: int | None = None

    @classmethod
    def of(cls, params, tokenizer, vocab_size: int, eos_token_ids, starts_after: int | None = None) -> "Grammar":
        """Compile and check a StructuredOutputsParams (InvalidRequestError names what is wrong)."""
        if tokenizer is None:
            raise InvalidRequestError("structured_outputs need a tokenizer, and this engine runs without one "
                                      "(skip_tokenizer_init=True)", param=_PARAM)
        if not eos_token_ids:
            raise InvalidRequestError("structured_outputs need an end-of-sequence token to end a complete output, "
                                      "and this model names none", param=_PARAM)
        ll_tok = grammar_tokenizer(tokenizer, vocab_size, eos_token_ids)
        text = grammar_text(params)
        with _pools_lock:
            pools = _pools.setdefault(tokenizer, {}).setdefault((vocab_size, tuple(sorted(eos_token_ids))),
                                                                OrderedDict())
            pool = pools.get(text)
            if pool is not None:
                pools.move_to_end(text)
        if pool is None:
            first = _llguidance().LLMatcher(ll_tok, text, log_level=0)
            if first.is_error():
                raise InvalidRequestError(f"structured_outputs.{params.kind} does not compile: "
                                          f"{first.get_error().strip()}", param=_PARAM)
            pool = MatcherPool(ll_tok, text, first)
            with _pools_lock:
                pools[text] = pool
                while len(pools) > MAX_COMPILED_PER_TOKENIZER:
                    pools.popitem(last=False)
        return cls(text, ll_tok, pool, starts_after)

    def matcher(self):
        """A matcher in its initial state, the caller's own (GrammarState gives it back)."""
        return self.pool.take()


class GrammarState:
    """A request's matcher and how many of its output tokens it has read (a Sequence's
    grammar_state, kept between steps). A grammar that starts after a token (Grammar.starts_after)
    reads the output for that token first: ``start`` is where the grammar's output begins, None
    while the token has not come."""

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self.matcher = grammar.matcher()
        # back to the pool when the request drops its state (the engine's Sequence, or a row's
        # state that no Sequence keeps); not at interpreter exit
        weakref.finalize(self, grammar.pool.give_back, self.matcher).atexit = False
        self.num_consumed = 0
        self.start: int | None = 0 if grammar.starts_after is None else None

    def active_from(self, drafts) -> int | None:
        """Where in these drafts (tokens after the output read so far) the grammar holds: 0 once it
        has started, just past its start token among them, None if it has not started by their end."""
        if self.start is not None:
            return 0
        marker = self.grammar.starts_after
        return next((j + 1 for j, t in enumerate(drafts) if t == marker), None)

    def advance(self, output: list[int], request_id="?") -> None:
        """Read the output tokens appended since the last call."""
        if len(output) < self.num_consumed:  # the output shrank (it never does): start again
            self.matcher.reset()
            self.num_consumed = 0
            self.start = 0 if self.grammar.starts_after is None else None
        if self.start is None:
            begins = self.active_from(output[self.num_consumed:])
            if begins is None:
                self.num_consumed = len(output)
                return
            self.start = self.num_consumed = self.num_consumed + begins
        new = output[self.num_consumed:]
        if new:
            if not self.matcher.consume_tokens(new):
                # every sampled token was drawn from this matcher's mask: a token it refuses means
                # the masks and the sampled rows went out of step (a bug, never the request's input)
                raise RuntimeError(f"request {request_id}: output token(s) {new} break its structured output "
                                   f"({self.matcher.get_error()})")
            self.num_consumed = len(output)


def _state(history, grammar: Grammar, output: list[int]) -> GrammarState:
    """A request's GrammarState, kept on the request when it can hold one (an engine Sequence:
    grammar_state), brought up to date with its output."""
    state = getattr(history, "grammar_state", False)
    if state is False:  # no history that keeps state (tests' rows): consume the output afresh
        state = GrammarState(grammar)
    elif state is None or state.grammar is not grammar:
        state = history.grammar_state = GrammarState(grammar)
    state.advance(output, getattr(history, "request_id", "?"))
    return state


def grammar_reach(seqs, drafts: list[list[int]]) -> list[int]:
    """Per request (engine Sequences), how many of its draft slots verification may need: one past
    its grammar's last leading valid draft, so that the first draft the grammar refuses is still
    verified (and rejected), and none after it, since nothing after it can be accepted. A request
    without a grammar may need them all.

    Why one past, not up to the last valid draft: the choice to verify slot j must not depend on
    draft j itself, only on the drafts before it (any such stopping rule keeps rejection sampling
    exact); skipping a refused draft d_j would replace the residual distribution its rejection
    samples from with the target's own at j, which is not the same law (a unit test pins this
    with an exact example; the chi-square test has too little power to see it)."""
    reach = []
    for seq, block in zip(seqs, drafts):
        rule = seq.logits_rule
        if rule is None or rule.grammar is None:
            reach.append(len(block))
            continue
        state = _state(seq, rule.grammar, seq.token_ids[len(seq.prompt_token_ids):])
        begins = state.active_from(block)
        if begins is None:  # the grammar does not start within these drafts: all may be accepted
            reach.append(len(block))
        else:
            reach.append(min(len(block), begins + state.matcher.validate_tokens(list(block[begins:])) + 1))
    return reach


def grammar_keep_mask(rows: list, vocab_size: int, device) -> torch.Tensor:
    """[len(rows), V] bool on `device`: the tokens each row's grammar allows next (rows: RuleRows
    whose rule has a grammar; row.extra are the drafts before a verification position). Rows of
    one request with the same history share one mask (adaptive verification repeats its last
    position for the slots it does not verify)."""
    ll = _llguidance()
    global _executor
    if _executor is None:
        _executor = ll.LLExecutor()
    groups: dict[int, dict[tuple, int]] = {}  # request -> {drafts before a position: its mask's index}
    first_row: dict[int, int] = {}  # request -> its first row
    for n, row in enumerate(rows):
        if row.pending >= 0:
            raise RuntimeError("a row with a grammar has its last token still on the device: the engine reads "
                               "such steps back first (async bookkeeping is broken)")
        key = id(row.history) if row.history is not None else id(row)
        groups.setdefault(key, {})[tuple(row.extra)] = -1
        first_row.setdefault(key, n)
    num_masks = 0
    for positions in groups.values():  # a request's masks consecutive, by position
        for extra in sorted(positions, key=len):
            positions[extra] = num_masks
            num_masks += 1
    mask_of = [groups[id(r.history) if r.history is not None else id(r)][tuple(r.extra)] for r in rows]
    words = (max(vocab_size, *(row.rule.grammar.tokenizer.vocab_size for row in rows)) + 31) // 32
    # all allowed until written: a verification position after a draft its grammar refuses is
    # never reached (that draft is rejected), and llguidance leaves it alone. (Pinned on CUDA: the
    # copy below then does not wait for the forward still running.)
    bits = torch.full((num_masks, words), -1, dtype=torch.int32, pin_memory=torch.device(device).type == "cuda")
    plain, drafted = [], []  # llguidance's batched calls: (matcher, first mask index[, drafts])
    for key, positions in groups.items():
        first = rows[first_row[key]]
        state = _state(first.history, first.rule.grammar, first.output)
        matcher = state.matcher
        ordered = sorted(positions, key=len)
        longest = ordered[-1]
        if len(ordered) == len(longest) + 1 and all(d == longest[:j] for j, d in enumerate(ordered)):
            # one block's verification positions (or one plain row): one call, drafts rolled back;
            # positions before the grammar starts (a thinking's end among the drafts) stay unmasked
            begins = state.active_from(longest)
            if begins is None:
                continue
            if begins < len(longest):
                drafted.append((matcher, positions[longest[:begins]], list(longest[begins:])))
            else:
                plain.append((matcher, positions[longest]))
            continue
        for extra in ordered:  # any other shape: one position at a time
            begins = state.active_from(extra)
            if begins is None:
                continue
            tokens = list(extra[begins:])
            consumed = matcher.try_consume_tokens(tokens) if tokens else 0
            if consumed == len(tokens):
                matcher.unsafe_compute_mask_ptr(bits[positions[extra]].data_ptr(), words * 4)
            if consumed:
                matcher.rollback(consumed)
    if plain:
        _executor.unsafe_compute_mask_ptr(plain, bits.data_ptr(), words * 4, num_masks)
    if drafted:
        _executor.unsafe_compute_mask_ptr_with_draft_token(drafted, bits.data_ptr(), words * 4, num_masks)
    _end_where_nothing_fits(bits, vocab_size, rows[0].rule.grammar.tokenizer.eos_tokens)
    # unpacked through a byte table: one byte per token (shifting the int32 words made two int32
    # tensors of the logits' size, 300 MB at 256 rows of a 152k vocabulary)
    packed = bits.to(device, non_blocking=True).view(torch.uint8)  # little-endian: byte b = tokens 8b..8b+7
    keep = _bit_table(device)[packed.long()].reshape(num_masks, words * 32)[:, :vocab_size]
    return keep[to_device(mask_of, device, torch.int64)] if mask_of != list(range(num_masks)) else keep


def _end_where_nothing_fits(bits: torch.Tensor, vocab_size: int, eos_tokens) -> None:
    """A mask that allows no token below the logits' width (a grammar whose only continuations are
    tokens the tokenizer has and the model cannot produce) allows the end of sequence instead: the
    output ends there, where a row of -inf would sample garbage that the matcher then refuses.
    In numpy: torch's CPU ops on these few words took ~1 ms a call on the H100 machine's 16-core
    host (H100 run 51's profile: 2 ms of a structured step); on the 2-core development machine,
    320 masks of 8,192 tokens, 0.08 ms with torch on 2 threads, 0.32 ms on 16, 0.03 ms in numpy
    (not yet measured on the GPU host)."""
    full, rest = divmod(vocab_size, 32)
    words = bits.numpy()
    some = (words[:, :full] != 0).any(1)
    if rest:
        some |= (words[:, full] & ((1 << rest) - 1)) != 0
    for r in np.flatnonzero(~some).tolist():
        for t in eos_tokens:
            bits[r, t // 32] |= 1 << (t % 32) if t % 32 < 31 else -(1 << 31)


_tables: dict[str, torch.Tensor] = {}


def _bit_table(device) -> torch.Tensor:
    """[256, 8] bool: the bits of each byte, lowest first."""
    key = str(device)
    if key not in _tables:
        byte = torch.arange(256, dtype=torch.int32)
        _tables[key] = ((byte[:, None] >> torch.arange(8, dtype=torch.int32)) & 1).bool().to(device)
    return _tables[key]
