"""What a request's sampling parameters do to the target's logits before its distribution is
formed, in vLLM V1's order: allowed_token_ids, bad_words, logit_bias, min_tokens, then the repetition,
frequency and presence penalties; after temperature, min_p (processed_probs then applies top-k and
top-p). A request with none of them has no rule and its rows are left alone.

Speculative decoding stays lossless: verification compares the drafter's q with the target's p
at each draft position, and p here is the rule applied with the history that position would
have, the request's output plus the drafts before it (`RuleRow.extra`). The drafter follows the
rule's additive part at the block's anchor (draft_bias); rejection sampling is exact for any q,
so that is for acceptance only.

The rule reads each request's whole history, which CUDA graphs do not hold, so it is applied
eagerly, after the graphs: the plain engine keeps ruled rows out of its graphed sampling, and the
graphed speculative step redoes a ruled row's verification from the verify graph's hidden states
(spec_decode/graphed_extras.py), in steps that are not pipelined.
"""
from __future__ import annotations

import math
import threading
from bisect import bisect_left
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from adaspec.errors import InvalidRequestError
from adaspec.h2d import to_device, to_device_many
from adaspec.sample.penalty_counts import pool_for
from adaspec.sample.structured_outputs import Grammar, grammar_keep_mask

# penalized rows are processed in chunks of about this many logits: their token counts are dense
# [rows, V] tensors (64 MB of float32 a chunk: 110 rows of a 151k vocabulary), while a
# verification step may have thousands of rows
CHUNK_ELEMENTS = 1 << 24


class SharedTensors:
    """Device tensors of rules' contents, shared by the requests whose rules hold the same contents
    (least recently used dropped past `capacity`): requests sent with the same allowed_token_ids or
    logit_bias (one client's settings, a benchmark's) make one mask and upload it once, not once
    each. A rule keeps the tensors it got, so a dropped entry only stops being shared."""

    def __init__(self, capacity: int = 32):
        self.capacity = capacity
        self._entries: OrderedDict = OrderedDict()
        self._lock = threading.Lock()  # engines of one process (threads) share it

    def get(self, key, make):
        with self._lock:
            t = self._entries.get(key)
            if t is None:
                t = self._entries[key] = make()
                while len(self._entries) > self.capacity:
                    self._entries.popitem(last=False)
            else:
                self._entries.move_to_end(key)
            return t

    def __len__(self) -> int:
        return len(self._entries)


_shared_tensors = SharedTensors()


def _allowed_mask(allowed: tuple[int, ...], V: int, device) -> torch.Tensor:
    t = torch.zeros(V, dtype=torch.bool, device=device)
    t[to_device(list(allowed), device, torch.int64)] = True
    return t


@dataclass(frozen=True)
class LogitsRule:
    """A request's logits processing (None of it: LogitsRule.of returns None)."""

    allowed: tuple[int, ...] | None  # allowed_token_ids: every other token is masked
    bad_words: tuple[tuple[int, ...], ...]  # token ids of each bad word's spellings (bad_word_ids)
    bias: tuple[tuple[int, float], ...]  # logit_bias: (token, value) added to its logit
    min_tokens: int
    min_tokens_ban: tuple[int, ...]  # masked while the output is shorter than min_tokens
    repetition: float  # 1: off
    frequency: float  # 0: off
    presence: float  # 0: off
    min_p: float  # 0: off
    grammar: Grammar | None = None  # structured_outputs (sample/structured_outputs.py)
    # its allowed mask and bias as device tensors, made at their first use on a device and kept:
    # built from the Python tuples every step, a whole-vocabulary logit_bias cost ~80 ms a step
    _tensors: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def allowed_mask(self, V: int, device) -> torch.Tensor:
        """[V] bool: the tokens it allows (read only: requests with the same ids share it)."""
        key = ("allowed", V, str(device))
        t = self._tensors.get(key)
        if t is None:
            t = self._tensors[key] = _shared_tensors.get((*key, self.allowed), lambda: _allowed_mask(
                self.allowed, V, device))
        return t

    def bias_tensors(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids [n] int64, biases [n] float32) of its logit_bias (read only, shared as above)."""
        key = ("bias", str(device))
        t = self._tensors.get(key)
        if t is None:
            t = self._tensors[key] = _shared_tensors.get((*key, self.bias), lambda: (
                to_device([b[0] for b in self.bias], device, torch.int64),
                to_device([b[1] for b in self.bias], device, torch.float32)))
        return t

    @classmethod
    def of(cls, params, eos_token_ids, vocab_size: int, tokenizer=None,
           grammar_after: int | None = None) -> "LogitsRule | None":
        """The rule of a request's (validated) SamplingParams; token ids are checked against the
        model's vocabulary here (SamplingParams cannot know it), and bad words are tokenized
        (tokenizer: the engine's; None without one). grammar_after: a token the structured output's
        grammar waits for (a thinking model's end of thinking). None: nothing to do."""
        bad_words = ()
        if params.bad_words:
            if tokenizer is None:
                raise InvalidRequestError("bad_words need a tokenizer, and this engine runs without one "
                                          "(skip_tokenizer_init=True)", param="bad_words")
            bad_words = bad_word_ids(params.bad_words, tokenizer)
            _ids_in_vocab([t for w in bad_words for t in w], vocab_size, "bad_words")
        allowed = None
        if params.allowed_token_ids is not None:
            allowed = tuple(sorted(set(_ids_in_vocab(params.allowed_token_ids, vocab_size, "allowed_token_ids"))))
        bias = ()
        if params.logit_bias:
            ids = _ids_in_vocab([int(t) for t in params.logit_bias], vocab_size, "logit_bias")
            bias = tuple((t, float(v)) for t, v in zip(ids, params.logit_bias.values()) if v != 0)
        min_tokens = params.min_tokens or 0
        ban = ()
        if min_tokens:
            # vLLM masks the end-of-sequence ids too when ignore_eos is set (its all_stop_token_ids)
            stops = set(params.stop_token_ids) | set(eos_token_ids)
            ban = tuple(sorted(t for t in stops if 0 <= t < vocab_size))
        grammar = None
        if params.structured_outputs is not None:
            grammar = Grammar.of(params.structured_outputs, tokenizer, vocab_size, eos_token_ids, grammar_after)
        rule = cls(allowed, bad_words, bias, min_tokens if ban else 0, ban,
                   float(params.repetition_penalty if params.repetition_penalty is not None else 1.0),
                   float(params.frequency_penalty or 0.0), float(params.presence_penalty or 0.0),
                   0.0 if params.greedy else float(params.min_p or 0.0), grammar)
        if rule.allowed is not None:  # a row with no token left would sample garbage (a NaN softmax)
            banned = set(rule.min_tokens_ban) | {w[0] for w in bad_words if len(w) == 1}
            if set(rule.allowed) <= banned:
                raise InvalidRequestError("allowed_token_ids leaves no token to sample: every one of them is a stop "
                                          "token that min_tokens holds back, or a one-token bad word",
                                          param="allowed_token_ids")
        return None if rule.is_neutral else rule

    @property
    def penalizes(self) -> bool:
        return self.repetition != 1.0 or self.frequency != 0.0 or self.presence != 0.0

    @property
    def is_neutral(self) -> bool:
        return (self.allowed is None and not self.bad_words and not self.bias and not self.min_tokens
                and not self.penalizes and self.min_p == 0.0 and self.grammar is None)


def bad_word_ids(words: list[str], tokenizer) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of bad words: each word as written (leading spaces stripped), and with
    one leading space where that is another spelling of the same length (a word in mid-text, for
    tokenizers that fold the space into the token)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if bare:
            out.append(bare)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return tuple(out)


def _ids_in_vocab(ids, vocab_size: int, name: str) -> list[int]:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"{name} has token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})",
                                  param=name)
    return list(ids)


@dataclass
class RuleRow:
    """One row of logits and the history its rule reads."""

    rule: LogitsRule
    temperature: float  # 0: greedy (min_p does not apply)
    prompt: list[int]  # the repetition penalty counts the prompt's tokens too (vLLM)
    output: list[int]  # the output tokens known on the host
    extra: list[int]  # tokens after them: the drafts before this verification position
    pending: int = -1  # >= 0: index into `pending_tokens` of one more output token still on the device
    history: object = None  # rows with the same history object share prompt and output (its counts are built once)

    @property
    def num_output(self) -> int:
        return len(self.output) + len(self.extra) + (self.pending >= 0)


def _constrained(rows: list[RuleRow | None]) -> list[int]:
    """The rows whose rule has structured outputs."""
    return [i for i, r in enumerate(rows) if r is not None and r.rule.grammar is not None]


def _mask_in_place(out: torch.Tensor, rows: list[RuleRow | None], constrained: list[int]) -> None:
    """Set to -inf, in `out`'s rows `constrained`, every token their grammar does not allow next."""
    at = to_device(constrained, out.device, torch.int64)
    keep = grammar_keep_mask([rows[i] for i in constrained], out.shape[-1], out.device)
    out[at] = out[at].masked_fill(~keep, float("-inf"))


def mask_grammars(logits: torch.Tensor, rows: list[RuleRow | None]) -> torch.Tensor:
    """logits [N, V] with each row's structured outputs mask applied (a copy; `logits` itself when
    no row has a grammar): what the reported logprobs see, as vLLM's, whose grammar bitmask goes on
    the logits before its sampler, while its other rules do not show in them."""
    constrained = _constrained(rows)
    if not constrained:
        return logits
    out = logits.clone()
    _mask_in_place(out, rows, constrained)
    return out


def logits_with_rules(logits: torch.Tensor, rows: list[RuleRow | None] | None,
                      pending_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the logits logprobs report: with the grammars' masks only, the logits sampled: with every
    rule); both `logits` itself when no row has a rule (rows None)."""
    if rows is None:
        return logits, logits
    shown = mask_grammars(logits, rows)
    return shown, apply_logits_rules(shown, rows, pending_tokens, grammars=False)


def apply_logits_rules(logits: torch.Tensor, rows: list[RuleRow | None],
                       pending_tokens: torch.Tensor | None = None, grammars: bool = True) -> torch.Tensor:
    """logits [N, V] -> float32 logits with each row's rule applied (rows[i] None: row i as is).
    Returns `logits` itself when no row has a rule (callers must not write into the result).
    pending_tokens: the device tokens RuleRow.pending indexes (async scheduling's last token).
    grammars: False leaves structured outputs' masks out (draft_bias; logits_with_rules, whose
    `logits` have them already)."""
    ruled = [i for i, r in enumerate(rows) if r is not None]
    if not ruled:
        return logits
    out = logits.to(torch.float32, copy=True)
    dev, V = out.device, out.shape[-1]
    constrained = _constrained(rows)
    if constrained and grammars:  # first, as vLLM applies its grammar bitmask before the sampler's processors
        _mask_in_place(out, rows, constrained)
    # the rules that can leave a row no token at all: masks, and biases or penalties that overflow
    # float32 to -inf (min_p keeps the likeliest)
    risky = [i for i in constrained if rows[i].rule.allowed is not None or rows[i].rule.bad_words or rows[i].rule.bias
             or rows[i].rule.penalizes or rows[i].num_output < rows[i].rule.min_tokens]
    if risky:
        at_risky = to_device(risky, dev, torch.int64)
        grammar_only = out[at_risky]

    def where(pairs):  # [(row, token)] -> index tensors
        return to_device([p[0] for p in pairs], dev, torch.int64), to_device([p[1] for p in pairs], dev, torch.int64)

    allowed = [i for i in ruled if rows[i].rule.allowed is not None]
    if allowed:
        keep = torch.stack([rows[i].rule.allowed_mask(V, dev) for i in allowed])
        at = to_device(allowed, dev, torch.int64)
        out[at] = out[at].masked_fill(~keep, float("-inf"))
    _ban_bad_words(out, [(i, rows[i]) for i in ruled if rows[i].rule.bad_words], pending_tokens)
    biased = [i for i in ruled if rows[i].rule.bias]
    if biased:
        parts = [rows[i].rule.bias_tensors(dev) for i in biased]
        sizes = [len(rows[i].rule.bias) for i in biased]
        at = torch.repeat_interleave(to_device(biased, dev, torch.int64), to_device(sizes, dev, torch.int64),
                                     output_size=sum(sizes))  # (known here: no device sync)
        out.index_put_((at, torch.cat([p[0] for p in parts])), torch.cat([p[1] for p in parts]), accumulate=True)
    ban = [(i, t) for i in ruled if rows[i].num_output < rows[i].rule.min_tokens for t in rows[i].rule.min_tokens_ban]
    if ban:
        out[where(ban)] = float("-inf")
    penalized = [i for i in ruled if rows[i].rule.penalizes]
    if penalized:
        _penalize(out, [(i, rows[i]) for i in penalized], pending_tokens, max(1, CHUNK_ELEMENTS // V))
    # a bias or a tiny repetition penalty can overflow float32 to +inf, whose softmax is NaN (a
    # silent token 0): the largest float32 instead, which keeps the token the likeliest
    out.clamp_(max=torch.finfo(torch.float32).max)
    min_p = [i for i in ruled if rows[i].rule.min_p > 0 and rows[i].temperature > 0]
    if min_p:
        # softmax(x / T) >= min_p * its max  <=>  x >= max(x) + T * ln(min_p)
        at = to_device(min_p, dev, torch.int64)
        x = out[at]
        shift = to_device([rows[i].temperature * math.log(rows[i].rule.min_p) for i in min_p], dev, torch.float32)
        cut = x.max(-1, keepdim=True).values + shift.unsqueeze(-1)
        out[at] = x.masked_fill(x < cut, float("-inf"))
    if risky:
        # a grammar row the other rules left without any token (min_tokens holding back the end
        # of a complete output, allowed_token_ids outside the grammar): the grammar wins, since a
        # row of -inf would sample garbage (a NaN softmax). On the device: no sync
        x = out[at_risky]
        dead = torch.isneginf(x).all(-1, keepdim=True)
        out[at_risky] = torch.where(dead, grammar_only, x)
    return out


def _ban_bad_words(out: torch.Tensor, rows: list[tuple[int, RuleRow]], pending_tokens: torch.Tensor | None) -> None:
    """Mask a bad word's last token where the history ends with the rest of it (vLLM's
    apply_bad_words: the output only, the prompt does not count). A history whose last token is
    still on the device (RuleRow.pending) is compared there: the ban is added as -inf where that
    token matches and 0 elsewhere (accumulated, so two words banning one token do not race)."""
    if not rows:
        return
    dev = out.device
    ban, maybe = [], []  # (row, token); (row, pending index, token the pending one must be, token)
    for i, row in rows:
        if row.pending >= 0 and row.extra:
            raise ValueError("a row with a pending token has no extra tokens (they would follow it)")
        hist = row.output + row.extra
        for word in row.rule.bad_words:
            *prefix, last = word
            if row.pending < 0:
                if len(prefix) <= len(hist) and hist[len(hist) - len(prefix):] == prefix:
                    ban.append((i, last))
            elif not prefix:
                ban.append((i, last))
            elif len(prefix) - 1 <= len(hist) and hist[len(hist) - len(prefix) + 1:] == prefix[:-1]:
                maybe.append((i, row.pending, prefix[-1], last))
    if ban:
        out[to_device([b[0] for b in ban], dev, torch.int64), to_device([b[1] for b in ban], dev, torch.int64)] = \
            float("-inf")
    if maybe:
        if pending_tokens is None:
            raise ValueError("a row counts a pending token, but no pending_tokens were given")
        hit = pending_tokens[to_device([m[1] for m in maybe], dev, torch.int64)].long() == \
            to_device([m[2] for m in maybe], dev, torch.int64)
        add = torch.where(hit, torch.full_like(hit, float("-inf"), dtype=torch.float32),
                          torch.zeros_like(hit, dtype=torch.float32))
        out.index_put_((to_device([m[0] for m in maybe], dev, torch.int64),
                        to_device([m[3] for m in maybe], dev, torch.int64)), add, accumulate=True)


def _penalize(out: torch.Tensor, rows: list[tuple[int, RuleRow]], pending_tokens: torch.Tensor | None,
              chunk: int) -> None:
    """vLLM's penalties for these rows: a repeated token's logit is divided by the repetition
    penalty (multiplied, when negative), then frequency x its output count and presence x (count
    > 0) are subtracted. Counts are dense [V] rows kept on the device per history (prompt and
    output; penalty_counts.py: brought up to date for every history at once), gathered per row,
    plus the row's own extra tokens and pending token; `chunk` rows at a time (their dense counts
    bound the memory), with one upload for them all."""
    dev, V = out.device, out.shape[-1]
    slot: dict[int, int] = {}  # history -> its index among the distinct histories
    histories: list[RuleRow] = []
    for _, row in rows:
        key = id(row.history) if row.history is not None else id(row)
        if key not in slot:
            slot[key] = len(histories)
            histories.append(row)
    pool = pool_for(V, dev)
    slots_t, lent = pool.update(histories)
    extra = [(n, t) for n, (_, row) in enumerate(rows) for t in row.extra]
    pend = [(n, row.pending) for n, (_, row) in enumerate(rows) if row.pending >= 0]
    if pend and pending_tokens is None:
        raise ValueError("a row counts a pending token, but no pending_tokens were given")
    extra_n, pend_n = [e[0] for e in extra], [p[0] for p in pend]
    extra_rows, extra_tokens, pend_rows, pend_at, at_all, of_row = to_device_many(
        [extra_n, [e[1] for e in extra], pend_n, [p[1] for p in pend], [i for i, _ in rows],
         [slot[id(r.history) if r.history is not None else id(r)] for _, r in rows]], dev)
    rep_all, freq_all, pres_all = (t.unsqueeze(-1) for t in to_device_many(
        [[r.rule.repetition for _, r in rows], [r.rule.frequency for _, r in rows],
         [r.rule.presence for _, r in rows]], dev, torch.float32))
    slot_of_row = slots_t[of_row]
    for c in range(0, len(rows), chunk):
        end = c + chunk
        counts, in_prompt = pool.gather(slot_of_row[c:end])
        e0, e1 = bisect_left(extra_n, c), bisect_left(extra_n, end)
        if e1 > e0:
            counts.index_put_((extra_rows[e0:e1] - c, extra_tokens[e0:e1]), torch.ones(e1 - e0, device=dev),
                              accumulate=True)
        p0, p1 = bisect_left(pend_n, c), bisect_left(pend_n, end)
        if p1 > p0:
            counts.index_put_((pend_rows[p0:p1] - c, pending_tokens[pend_at[p0:p1]].long()),
                              torch.ones(p1 - p0, device=dev), accumulate=True)
        at, rep, freq, pres = at_all[c:end], rep_all[c:end], freq_all[c:end], pres_all[c:end]
        if _sparse_penalties(dev):
            # only the (row, token) pairs the history holds: a few hundred of each row's V logits
            r, t = (counts > 0).logical_or_(in_prompt).nonzero(as_tuple=True)
            n, rows_at = counts[r, t], at[r]
            x = out[rows_at, t]
            x = torch.where(x > 0, x / rep[r, 0], x * rep[r, 0])  # (a penalty of 1 divides by 1: exact)
            out[rows_at, t] = x - freq[r, 0] * n - pres[r, 0] * (n > 0).float()
            continue
        x = out[at]
        seen = counts > 0
        repeated = (seen | in_prompt) & (rep != 1.0)
        x = torch.where(repeated, torch.where(x > 0, x / rep, x * rep), x)
        x = x - freq * counts - pres * seen.float()
        out[at] = x
    del lent  # the rows lent for this call go back to the pool, after its gathers were queued


def _sparse_penalties(device: torch.device) -> bool:
    """Penalize only the tokens a history holds (their indices found by `nonzero`, which reads its
    result's size back) instead of every [rows, V] logit: on a CPU the read back is free and 320
    rows of an 8,192 vocabulary took 41 ms a call dense (fixed:4 verification, 64 requests). On
    CUDA the read back would stall the step's launches, so the dense ops stay there. Both give the
    same floats: untouched logits minus 0 are themselves, and x / 1 is x."""
    return device.type == "cpu"


def rows_of(seqs, extras: list[list[int]] | None = None,
            pending: list[int] | None = None) -> list[RuleRow | None] | None:
    """The RuleRows of logits rows that belong to these requests (engine Sequences, one per row;
    a request may own several rows, e.g. its verification positions). extras[n]: tokens after
    row n's request's own (drafts); pending[n] >= 0: its last token is a placeholder whose token
    is pending_tokens[pending[n]] on the device (async scheduling). None when no row has a rule."""
    if all(s.logits_rule is None for s in seqs):
        return None
    outputs: dict[int, list[int]] = {}
    rows: list[RuleRow | None] = []
    for n, s in enumerate(seqs):
        rule = s.logits_rule
        if rule is None:
            rows.append(None)
            continue
        out = outputs.get(id(s))
        if out is None:
            out = s.token_ids[len(s.prompt_token_ids):]
            if out and out[-1] < 0:  # a placeholder (engine/async_step.py's PENDING)
                if pending is None or pending[n] < 0:
                    raise RuntimeError(f"request {s.request_id}: its last token is still on the device and "
                                       "the logits rules were not told where (async bookkeeping is broken)")
                out = out[:-1]
            outputs[id(s)] = out
        p = pending[n] if pending is not None else -1
        rows.append(RuleRow(rule, 0.0 if s.params.greedy else float(s.params.temperature), s.prompt_token_ids, out,
                            extras[n] if extras is not None else [], p, history=s))
    return rows


def draft_bias(seqs, vocab_size: int, device) -> torch.Tensor | None:
    """[R, V] float32 for the drafter's logits of these requests (None when none has a rule), or
    [R, 2, V] when some have structured outputs (the first draft slot's, then the other slots'): the
    rules applied to zero logits, i.e. their additive part at the anchor (allowed ids, bad words,
    logit_bias, min_tokens, frequency and presence over the output so far; the repetition penalty
    leaves zeros alone, and min_p is left out: the rows are taken as greedy, since on zeros plus a
    bias it would keep the biased tokens only). The drafter then proposes what the target may
    accept (an allowed_token_ids request's drafts were otherwise rejected wholesale); the drafts
    within the block are not counted, which costs acceptance, never exactness (any q is exact)."""
    rows = rows_of(seqs)
    if rows is None:
        return None
    for row in rows:
        if row is not None:
            row.temperature = 0.0  # (min_p applies to sampled rows only)
    # structured outputs' masks hold for the first slot only: the slots after it follow drafts the
    # host does not know yet. Then [R, 2, V]: the first slot's bias, the other slots'
    bias = apply_logits_rules(torch.zeros(len(seqs), vocab_size, device=device), rows, grammars=False)
    constrained = _constrained(rows)
    if not constrained:
        return bias
    first = bias.clone()
    _mask_in_place(first, rows, constrained)
    # (the rules may leave the grammar nothing: the first slot then drafts as the others do)
    first = torch.where(torch.isneginf(first).all(-1, keepdim=True), bias, first)
    return torch.stack([first, bias], 1)
