"""The adaptive verification budget: how many drafts of each request to verify this step.

Objective (VERIFY.md): with survivals ``a_{r,j} = prod_{i<=j} c_{r,i}``,
    B* = argmax_{B=0..Bmax} (n_sampling + sum of the B largest a) / (draft_ms(R) + verify_ms(T + B))
(ties to the smaller B), then ``l_r`` = number of r's slots among the B* largest survivals.
With narrow-draft tables (adaptive_draft_width "budget") the step also picks how many slots per
request to draft, w, one of the profiled widths: B and w together maximize
    (n_sampling + sum of the B largest a_{r,j} with j < w) / (draft_ms(R, w) + verify_ms(T + B)),
so that a loaded step can draft 2 or 4 slots of every request and spread B over those, as a fixed
short k does, instead of paying the full draft for the few requests deep slots would go to
(width_capped_objective). The step then drafts w slots and allocates B among them (graphed or
eager: both take the budget and the width before drafting).
The draft cost sits in EVERY candidate's denominator, B = 0 included: when B* = 0 is chosen
the drafts are thrown away but they were already paid for, so the ratio that B = 0 competes
with is the honest one for a step in which drafting happened. (Skipping the drafter entirely
is a different decision, the no-spec arm, and is not made here.)

Why the design below is lossless
--------------------------------
Rejection sampling emits exactly the target distribution as long as, for every slot (r, j),
the decision "verify slot j of r" is a function of things that are independent of the draft
x_{r,j} given the emitted prefix: quantities from earlier steps, other requests' drafts (drawn
with independent randomness), and r's own earlier drafts x_{r,<j}. The latter are allowed
because slot j is only reached when x_{r,1..j-1} were all accepted, i.e. when they ARE the
emitted prefix; conditioning on the emitted past never biases the next token. Formally, each
emitted token Y_t has law p(.|Y_<t) given everything decided before it, and the tower rule
multiplies these into the target's joint law.

Now ``c_{r,i}`` depends on x_{r,i-1} (Markov feature), so ``a_{r,j}`` depends on x_{r,<j} only:
  * B* is computed from the PREVIOUS step's confidences (requests without any count as 1.0
    for every slot), so B* involves no current draft at all; so is the draft width w, which then
    caps every request's slots as a limit does.
  * Slot (r, j) is admitted iff fewer than B* slots outrank it in the order
    (survival desc, then flat index r*K + j asc). Who outranks (r, j)?  Other requests' slots
    (independent of x_{r,j}), and r's slots 1..j-1 (always: survivals never increase along j
    and ties go to the earlier slot), but NEVER r's slots j+1.. since a_{r,i} <= a_{r,j} for
    i > j and they lose ties. Hence admission of (r, j) depends on a_{r,j}, j, B* and other
    requests only: none of these involves x_{r,j}. Lossless, and every l_r is a prefix.
Corner cases where top-B by current survival would NOT be lossless, and how we close them:
  * survivals that increase along j (a confidence > 1, NaN, or a parallel cumprod that rounds
    a later product above an earlier one): then a_{r,j+1}, which depends on x_{r,j}, could
    outrank slot j and decide whether x_{r,j} is verified. We clip confidences to [0, 1]
    (NaN -> 0) and take a running minimum after the product, so survivals are exactly
    non-increasing on every device.
  * a budget computed from the current drafts (the LEAKY variant kept below for tests): then
    whether x_{r,j} is verified depends on a_{r,j+1} through B*, i.e. on x_{r,j} itself; the
    paper's two-token example turns a (0.7, 0.3) target into (0.85, 0.15).
  * per-request caps (remaining max_tokens) must depend on the request, not its drafts; they
    are applied as masks, which is fine.
The optional EMA only smooths the stored (old) confidences, so it keeps B* draft-independent.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import numpy as np

from adaspec.spec_decode.step_costs import DRAFT, PLAIN

try:  # torch is optional for the numpy path
    import torch
except ImportError:  # pragma: no cover
    torch = None


# -- survivals and calibration temperatures -----------------------------------------------
def survival(conf: np.ndarray) -> np.ndarray:
    """a[..., j] = prod_{i<=j} conf[..., i], confidences clipped to [0, 1], non-increasing."""
    c = np.asarray(conf, dtype=np.float64)
    a = np.cumprod(np.where(c > 0.0, np.minimum(c, 1.0), 0.0), axis=-1)  # NaN -> 0
    return np.minimum.accumulate(a, axis=-1)


def survival_torch(conf: "torch.Tensor") -> "torch.Tensor":
    """Device version of :func:`survival` (no host sync)."""
    a = torch.cumprod(torch.nan_to_num(conf.float(), nan=0.0).clamp(0.0, 1.0), dim=-1)
    return torch.cummin(a, dim=-1).values  # guards against parallel-scan rounding


def apply_temperature(x, temps, is_logit: bool = True):
    """Sequential-temperature-scaled confidences ``sigmoid(logit_j / T_j)`` per slot j.

    ``x``: [..., K] confidence logits (or probabilities with ``is_logit=False``), numpy or torch;
    ``temps``: [K] (or None: identity). Returns the same array type as ``x``.
    """
    if torch is not None and isinstance(x, torch.Tensor):
        logit = x.float() if is_logit else torch.logit(x.float().clamp(1e-7, 1 - 1e-7))
        if temps is None:
            return torch.sigmoid(logit)
        t = torch.as_tensor(temps, dtype=logit.dtype, device=logit.device)
        return torch.sigmoid(logit / t[: logit.shape[-1]])
    x = np.asarray(x, dtype=np.float64)
    logit = x if is_logit else np.log(np.clip(x, 1e-12, 1) / np.clip(1 - x, 1e-12, 1))
    if temps is not None:
        logit = logit / np.asarray(temps, dtype=np.float64)[: logit.shape[-1]]
    return 1.0 / (1.0 + np.exp(-logit))


# -- the budget ----------------------------------------------------------------------------
def _vec(fn, x: np.ndarray) -> np.ndarray:
    """Call a cost function on an array; fall back to element-wise for scalar-only callables."""
    try:
        y = np.asarray(fn(x), dtype=np.float64)
        if y.shape == x.shape:
            return y
    except Exception:
        pass
    return np.array([float(fn(int(v))) for v in x], dtype=np.float64)


def budget_objective(survivals: np.ndarray, n_sampling: int, base_tokens: int, num_requests: int,
                     cost: Any, max_budget: int | None = None) -> np.ndarray:
    """Ratio (expected tokens / step ms) for every B = 0..Bmax, as an array of length Bmax+1 (with
    narrow-draft tables: at each B, that of the best draft width: width_capped_objective)."""
    return width_capped_objective(survivals, n_sampling, base_tokens, num_requests, cost, max_budget)[0]


def prices_widths(cost: Any) -> bool:
    """Whether the cost model has narrow-draft tables (cost_model.CostModel.draft_narrow)."""
    return bool(getattr(cost, "prices_widths", False))


def priced_widths(cost: Any, num_requests: int, k: int) -> tuple[list[int], np.ndarray]:
    """(the draft widths worth weighing, ascending and ending at k; the draft price of every width
    1..k). A cost model prices a width by the narrowest profiled draft that holds it, so within a
    run of equal prices the widest is the one to weigh: it allows more and costs the same."""
    prices = np.asarray(step_draft_ms(cost, num_requests, np.arange(1, k + 1)), dtype=np.float64)
    return [w for w in range(1, k + 1) if w == k or prices[w - 1] != prices[w]], prices


def width_capped_objective(survivals: np.ndarray, n_sampling: int, base_tokens: int, num_requests: int,
                           cost: Any, max_budget: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(objective, width, gain), arrays over B = 0..Bmax: the best rate (expected tokens / step ms)
    a step verifying B drafts can reach, the draft width (slots per request) that reaches it, and
    the expected tokens it counts (n_sampling + the survivals verified).

    Without narrow-draft tables every step drafts all k slots: the rate of the B largest
    survivals, width k. With them, each profiled width w is weighed with the B largest survivals
    among the slots j < w of every request (the step caps each request at w) and w's own draft
    price; B's entry is the best of them (ties to the narrower width). A width holding fewer than
    B slots in all cannot verify B: it does not compete there."""
    a = np.asarray(survivals, dtype=np.float64)
    K = a.shape[-1] if a.ndim == 2 else 1
    if not prices_widths(cost) or a.size == 0:
        flat = np.sort(a.ravel())[::-1]
        bmax = flat.size if max_budget is None else max(0, min(int(max_budget), flat.size))
        gain = n_sampling + np.concatenate(([0.0], np.cumsum(flat[:bmax])))
        den = float(cost.draft_ms(num_requests)) + step_verify_ms(cost, num_requests, base_tokens + np.arange(bmax + 1))
        return gain / np.maximum(den, 1e-12), np.full(bmax + 1, K, dtype=np.int64), gain
    order = np.argsort(-a.ravel(), kind="stable")  # allocate's order: survival desc, then flat index
    flat, slot = a.ravel()[order], order % K
    bmax = flat.size if max_budget is None else max(0, min(int(max_budget), flat.size))
    verify = np.asarray(step_verify_ms(cost, num_requests, base_tokens + np.arange(bmax + 1)), dtype=np.float64)
    objective = np.full(bmax + 1, -np.inf)
    width = np.full(bmax + 1, K, dtype=np.int64)
    gain = np.zeros(bmax + 1)
    widths, prices = priced_widths(cost, num_requests, K)
    for w in widths:  # narrow first: a tie keeps the narrower (cheaper to run) width
        kept = flat[slot < w]  # still in allocate's order
        n = min(kept.size, bmax) + 1
        g = n_sampling + np.concatenate(([0.0], np.cumsum(kept[: n - 1])))
        rate = g / np.maximum(prices[w - 1] + verify[:n], 1e-12)
        better = rate > objective[:n]
        objective[:n] = np.where(better, rate, objective[:n])
        width[:n] = np.where(better, w, width[:n])
        gain[:n] = np.where(better, g, gain[:n])
    return objective, width, gain


def step_draft_ms(cost: Any, num_requests: int, need: np.ndarray) -> np.ndarray:
    """draft_ms of num_requests for each entry of `need` (slots per request the step must draft):
    a cost model with narrow-draft tables (prices_widths; cost_model.CostModel.draft_ms_width)
    prices the width that holds it; any other prices the full draft."""
    if prices_widths(cost):
        return np.asarray(cost.draft_ms_width(num_requests, need), dtype=np.float64)
    return np.full(np.shape(need), float(cost.draft_ms(num_requests)))


def step_verify_ms(cost: Any, num_requests: int, tokens):
    """verify_ms of a step of `tokens` query tokens over num_requests requests: a cost model that
    knows the step's padding (graphed_step.GraphPaddedCost: CUDA graphs run padded token counts)
    answers for the pair; a plain one prices the tokens alone."""
    per_step = getattr(cost, "verify_ms_for", None)
    if per_step is not None:
        return per_step(num_requests, np.asarray(tokens))
    return _vec(cost.verify_ms, np.asarray(tokens))


def choose_budget(survivals: np.ndarray, n_sampling: int, base_tokens: int, num_requests: int,
                  cost: Any, max_budget: int | None = None) -> int:
    """B* over ALL B = 0..Bmax (cost tables are step-shaped: the ratio is not unimodal).

    Ties go to the smaller B (np.argmax returns the first maximum). Pass survivals that no
    current draft influenced (one-step-old, see :class:`AdaptiveBudget`) to stay lossless.
    """
    return choose_budget_width(survivals, n_sampling, base_tokens, num_requests, cost, max_budget)[0]


def choose_budget_width(survivals: np.ndarray, n_sampling: int, base_tokens: int, num_requests: int,
                        cost: Any, max_budget: int | None = None) -> tuple[int, int]:
    """(B*, the draft width that reaches it): choose_budget's budget, and the slots per request the
    step then drafts and caps every request at (width_capped_objective; k without narrow tables)."""
    objective, widths, _ = width_capped_objective(survivals, n_sampling, base_tokens, num_requests, cost, max_budget)
    b = int(np.argmax(objective))
    return b, int(widths[b])


@dataclass(frozen=True)
class MixedStepTerms:
    """What mixed_step_drafts weighs (benchmarks/mixed_step_check.py tables them)."""
    budget: int  # B*, the decode-only objective's (0: the drafts would all be thrown away)
    gain: float = 0.0  # S(B*): the expected extra tokens of drafting
    ref: float = 0.0  # r_ref, tokens per ms the extra time is valued at
    t_plain: float = 0.0  # ms of the step without drafts
    t_draft: float = 0.0  # ms of the step with them
    width: int | None = None  # slots per request the step drafts (width_capped_objective's, at B*)

    @property
    def drafts(self) -> bool:
        return self.budget > 0 and self.gain > self.ref * (self.t_draft - self.t_plain)


def mixed_step_drafts(survivals: np.ndarray, n_sampling: int, decode_tokens: int, prefill_tokens: int,
                      num_requests: int, cost: Any, prefill_apart: bool,
                      ref_rate: float | None = None) -> tuple[bool, int]:
    """(drafts, B*) of mixed_step_terms."""
    terms = mixed_step_terms(survivals, n_sampling, decode_tokens, prefill_tokens, num_requests, cost, prefill_apart,
                             ref_rate)
    return terms.drafts, terms.budget


def mixed_step_terms(survivals: np.ndarray, n_sampling: int, decode_tokens: int, prefill_tokens: int,
                     num_requests: int, cost: Any, prefill_apart: bool,
                     ref_rate: float | None = None) -> MixedStepTerms:
    """Whether the decoding rows of a step that also carries prefill_tokens of prompt chunks should
    draft, and B* if they do (adaptive_verification_mixed_steps "fused"), with the terms weighed.

    The chunks cost the step their forward whichever way it goes, so the rate of the whole step
    (what the decode-only objective maximizes) is the wrong yardstick: diluted by the chunks' time,
    any drafting looks cheap. Judged at the margin instead: drafting's expected extra tokens, the B*
    best survivals' sum S(B*), must beat what its extra time would make in decode-only steps at the
    best rate the tables offer there, r_ref = max(decode-only objective at B*, plain n / verify(T)).
    Without drafts the decoding rows ride in the chunks' forward: verify_ms(T + P). With drafts:
    draft_ms(R) + verify(T + B*) + verify(P) when the chunks run as their own forward (prefill_apart:
    the graphed pipelined step), draft_ms(R) + verify(T + B* + P) when one forward carries both (the
    eager step). Drafts iff S(B*) > r_ref * (t_draft - t_plain). B* is the decode-only objective's
    (survivals of no current draft: the decision, like B*, is lossless). Prompt tokens past the
    tables' largest size are priced by their linear extrapolation (cost_model.py).

    ref_rate (tokens per ms), where given, replaces r_ref: the rate the engine's decode-only steps
    really made (AdaptivePolicy passes it under measured step costs). The tables' rate counts GPU
    time only and the curve's acceptance, so it can be far above any real step's: on the code-0.6b
    pair at 256 requests, T = 0, 143.5 tokens per ms against 60-71 measured in the fused arm's
    decode-only steps, where drafting beside a chunk would add 114-122 tokens per ms of its priced
    extra time (H100 run 50); on the Qwen3-8B shape at T = 1, 256 requests, the tables' 27.1
    against 17.7-19.2 measured in the adaptive arms' decode-only steps at 256 rows, where drafting
    would add 15.8-17.4 (H100 run 60; benchmarks/chunk_step_prices.py prints the arms' rates).
    Valued at the measured rates, the rule drafts beside chunks on the first and keeps them plain
    on the second, there by a thin margin (2-22%): the better choice each shape
    measured (the separate mode, which drafts there, on the first, runs 50-51; the fused mode's
    plain chunk steps on the second, H200 run 45). Read from those runs on the CPU (BENCHMARKS.md,
    "The fused mode's margin valued at measured rates"); its arm's one run on the pair (H100 run
    62) lost for other reasons, unpipelined steps and a noisy rate at one request, both changed
    since, so the margin itself is still unmeasured. The rate comes from past steps only, so the
    decision stays lossless."""
    objective, widths, gains = width_capped_objective(survivals, n_sampling, decode_tokens, num_requests, cost)
    b = int(np.argmax(objective))
    if b == 0:  # the drafts would all be thrown away
        return MixedStepTerms(0)
    gain = float(gains[b]) - n_sampling
    verify_b = float(np.ravel(step_verify_ms(cost, num_requests, decode_tokens + b))[0])
    draft = (n_sampling + gain) / float(objective[b]) - verify_b  # the draft as the objective priced it
    plain_rate = n_sampling / max(float(np.ravel(step_verify_ms(cost, num_requests, decode_tokens))[0]), 1e-12)
    ref = max(float(objective[b]), plain_rate) if ref_rate is None else float(ref_rate)
    t_plain = float(np.ravel(cost.verify_ms(decode_tokens + prefill_tokens))[0])
    if prefill_apart:  # two forwards, one step: a per-step overhead in the prices (OverheadCost) counts once
        overhead = float(getattr(getattr(cost, "overhead", None), "value", 0.0))
        t_draft = draft + verify_b + float(np.ravel(cost.verify_ms(prefill_tokens))[0]) - overhead
    else:
        t_draft = draft + float(np.ravel(cost.verify_ms(decode_tokens + b + prefill_tokens))[0])
    return MixedStepTerms(b, gain, ref, t_plain, t_draft, int(widths[b]))


def draft_widths(k: int, narrow: bool) -> list[int]:
    """The draft widths (slots per request) the adaptive step may draft: k, or with
    adaptive_draft_width "budget" also about k/4 and k/2 (the fewest that hold the step's budget
    is drafted: AdaptivePolicy.draft_width)."""
    if not narrow:
        return [k]
    return sorted({max(1, -(-k // 4)), max(1, -(-k // 2)), k})


# -- allocation ----------------------------------------------------------------------------
def _masked(survivals, limits, K, xp_where, arange):
    # slots at or beyond a request's limit sort below every real slot (-1 < 0 <= a)
    return xp_where(arange[None, :] < limits[:, None], survivals, -1.0)


def allocate(survivals: np.ndarray, budget: int, limits: np.ndarray | None = None) -> np.ndarray:
    """l_r = number of r's slots among the ``budget`` largest survivals.

    Order: survival descending, ties by flat index r*K + j (earlier request, then earlier slot),
    which with non-increasing survivals makes every l_r a prefix. ``limits`` [R] (optional)
    caps each request (e.g. remaining max_tokens); it depends on no draft, so it stays lossless.
    """
    a = np.asarray(survivals, dtype=np.float64)
    R, K = a.shape
    if limits is not None:
        limits = np.asarray(limits, dtype=np.int64)
        a = _masked(a, limits, K, np.where, np.arange(K))
    b = max(0, min(int(budget), R * K))
    order = np.argsort(-a.ravel(), kind="stable")[:b]
    if limits is not None:
        order = order[a.ravel()[order] >= 0]
    return np.bincount(order // K, minlength=R).astype(np.int64) if K else np.zeros(R, np.int64)


def allocate_torch(survivals: "torch.Tensor", budget, limits: "torch.Tensor | None" = None) -> "torch.Tensor":
    """Device version of :func:`allocate`: same order and ties, ``budget`` may be a 0-d tensor,
    no device-to-host sync (a stable sort gives each slot its rank; admit rank < budget)."""
    R, K = survivals.shape
    a = survivals.float()
    if limits is not None:
        a = _masked(a, limits.to(a.device, non_blocking=True), K, torch.where, torch.arange(K, device=a.device))
    flat = a.reshape(-1)
    rank = _stable_descending_rank(flat)
    # a python int is compared directly (no host-to-device copy); a tensor budget stays on device
    b = budget.to(flat.device, non_blocking=True) if isinstance(budget, torch.Tensor) else int(budget)
    admitted = (rank < b) & (flat >= 0)
    return admitted.view(R, K).sum(dim=1)


# up to this many slots the rank is counted pairwise (N^2 compares; 1,792 at 256 requests x 7)
PAIRWISE_RANK_MAX = 2048


def _stable_descending_rank(flat: "torch.Tensor") -> "torch.Tensor":
    """Each element's place in a stable descending sort of ``flat``: the elements above it, plus
    the equal ones before it. Counted pairwise for the graphs' sizes, a broadcast compare and a
    sum that the compiler fuses into one reduction kernel, where the sort and the scatter of its
    order were an aten radix sort, its copies, an arange and a scatter (H100 run 69: the adaptive
    propose graph 69 kernels instead of 76 and 0.210 ms instead of 0.222 at one request, adaptive:7
    0.998 of fixed:7 instead of 0.990, synthetic acceptance). Beyond PAIRWISE_RANK_MAX, where the
    N^2 compares grow, the sort stays."""
    n = flat.numel()
    idx = torch.arange(n, device=flat.device)
    if n > PAIRWISE_RANK_MAX:
        order = torch.sort(flat, descending=True, stable=True).indices
        return torch.empty_like(order).scatter_(0, order, idx)
    other, this = flat[None, :], flat[:, None]
    before = (other > this) | ((other == this) & (idx[None, :] < idx[:, None]))
    return before.sum(dim=1)


# -- stateful helper: B* from old confidences, allocation from current ones -----------------
class AdaptiveBudget:
    """Per-step planner. Keeps each request's last confidences (optionally EMA-smoothed).

    Engine loop (CPU):  lengths = ab.plan(ids, conf_now, n_sampling, base_tokens)
                        ... verify / accept ...;  ab.observe(ids, conf_now)
    On CUDA:  b = ab.budget(ids, n_sampling, base_tokens) on the host from the old copy,
              lengths = allocate_torch(survival_torch(conf_now), b) on the device,
              ab.observe(ids, conf_now copied to host asynchronously); ab.forget(id) when done.
    """

    def __init__(self, cost: Any, k: int, ema_alpha: float | None = None, max_budget: int | None = None,
                 unknown: str = "one", correction=None):
        if ema_alpha is not None and not 0.0 < ema_alpha <= 1.0:
            raise ValueError("ema_alpha must be in (0, 1] or None")
        if unknown not in ("one", "population"):
            raise ValueError(f"unknown must be 'one' or 'population', got {unknown!r}")
        self.cost, self.k, self.ema_alpha, self.max_budget = cost, int(k), ema_alpha, max_budget
        # what a request never observed counts as: 1.0 per slot ("one", vLLM's optimism), or the
        # average of the confidences observed so far ("population": steps that do not draft leave
        # new requests unobserved for a while, and 1.0 would overrate drafting for all of them)
        self.unknown = unknown
        self.population: np.ndarray | None = None  # running average of observed confidences [K]
        # last confidences live in one array (row per request) so a step is a few numpy ops
        self._row: dict[Hashable, int] = {}
        self._conf = np.ones((64, self.k))
        self._free: list[int] = list(range(63, -1, -1))  # pop() hands out low rows first
        self.last_budget: int | None = None
        self.last_width: int | None = None  # the draft width chosen with last_budget (its objective's)
        # online_calibration.SurvivalCorrection, or None: the budget's survivals as the confidences say
        self.correction = correction

    @property
    def last_conf(self) -> dict[Hashable, np.ndarray]:
        """request id -> stored confidences [K] (a copy, for inspection)."""
        return {rid: self._conf[i].copy() for rid, i in self._row.items()}

    def _rows(self, request_ids: Sequence[Hashable], create: bool) -> np.ndarray:
        get = self._row.get
        rows = [get(rid, -1) for rid in request_ids]  # a list first: numpy's item assignment is slow
        if create and -1 in rows:
            for n, rid in enumerate(request_ids):
                i = get(rid)  # (an id listed twice gets one row)
                if i is None:
                    if not self._free:  # grow x2
                        old = self._conf.shape[0]
                        self._conf = np.concatenate([self._conf, np.ones((old, self.k))])
                        self._free = list(range(2 * old - 1, old - 1, -1))
                    i = self._free.pop()
                    self._row[rid] = i
                    self._conf[i] = np.nan  # marks "never observed" for the EMA
                rows[n] = i
        return np.array(rows, dtype=np.int64)

    def old_confidences(self, request_ids: Sequence[Hashable]) -> np.ndarray:
        """[R, K] stored confidences; unknown requests (and never-set entries) count as 1.0, or
        as the population average (unknown="population") once there is one."""
        rows = self._rows(request_ids, create=False)
        out = self._conf[np.maximum(rows, 0)]
        prior = self.population if self.unknown == "population" and self.population is not None else 1.0
        out[rows < 0] = prior
        return np.where(np.isnan(out), prior, out)

    def budget(self, request_ids: Sequence[Hashable], n_sampling: int, base_tokens: int,
               num_requests: int | None = None, limits: np.ndarray | None = None) -> int:
        """B* from one-step-old confidences only (safe to compute before drafting)."""
        a = survival(self.old_confidences(request_ids))
        if self.correction is not None:  # what the target has really accepted lately, per position
            a = self.correction.apply(a)
        if limits is not None:
            a = np.where(np.arange(self.k)[None, :] < np.asarray(limits)[:, None], a, 0.0)
        nreq = len(request_ids) if num_requests is None else num_requests
        self.last_budget, self.last_width = choose_budget_width(a, n_sampling, base_tokens, nreq, self.cost,
                                                                self.max_budget)
        return self.last_budget

    def plan(self, request_ids: Sequence[Hashable], current_conf: np.ndarray, n_sampling: int, base_tokens: int,
             num_requests: int | None = None, limits: np.ndarray | None = None) -> np.ndarray:
        """Verify lengths l_r [R] for this step (current_conf: [R, K] conditional confidences)."""
        self.budget(request_ids, n_sampling, base_tokens, num_requests, limits)
        return allocate(survival(current_conf), self.last_budget, limits)

    def observe(self, request_ids: Sequence[Hashable], conf: np.ndarray) -> None:
        """Store this step's confidences [R, K] (K may be < k: the rest count as 1.0). NaN marks a
        slot this step did not draft (a narrower draft, adaptive_draft_width "budget"): it keeps
        the request's stored confidence, or takes the population's when there is none."""
        conf = np.asarray(conf, dtype=np.float64)
        new = np.ones((conf.shape[0], self.k))
        new[:, : min(self.k, conf.shape[1])] = conf[:, : self.k]
        missing = np.isnan(new)
        narrow = bool(missing.any())
        if len(new):  # from this step's confidences only (before the per-request EMA)
            if narrow:  # per slot, over the requests that drafted it; a slot none drafted stays as it was
                seen = (~missing).sum(axis=0)
                was = np.ones(self.k) if self.population is None else self.population
                mean = np.where(seen > 0, np.where(missing, 0.0, new).sum(axis=0) / np.maximum(seen, 1), was)
            else:
                mean = new.mean(axis=0)
            self.population = mean if self.population is None else 0.2 * mean + 0.8 * self.population
        rows = self._rows(request_ids, create=True)
        old = self._conf[rows]
        if narrow:
            new = np.where(missing, np.where(np.isnan(old), self.population[None, :], old), new)
        if self.ema_alpha is not None:
            new = np.where(np.isnan(old), new, self.ema_alpha * new + (1.0 - self.ema_alpha) * old)
        self._conf[rows] = new

    def forget(self, request_id: Hashable) -> None:
        i = self._row.pop(request_id, None)
        if i is not None:
            self._free.append(i)


# -- the policies the speculative step calls: verify every reserved slot, or the adaptive budget
class FixedPolicy:
    def should_draft(self, request_ids, n_sampling, base_tokens, limits, prefill_tokens: int = 0,
                     prefill_apart: bool = False) -> bool:
        return True

    def plan(self, request_ids, conf, n_sampling, base_tokens, limits, whole: bool = True):
        return np.asarray(limits, dtype=np.int64)

    def observe(self, request_ids, conf) -> None:
        pass

    def forget(self, request_id) -> None:
        pass

    def observe_step(self, wall_ms: float) -> None:
        pass

    def step_tokens(self, tokens: int) -> None:
        pass

    def observe_outcomes(self, verify_lens, accepted, survivals) -> None:
        pass


class AdaptivePolicy:
    """Besides the budget, decides whether drafting pays at all this step (beyond vLLM, whose
    budget can only drop to B = 0 after the drafts were paid for). From the tables: the best
    expected rate with drafting, (n_sampling + sum of the B best OLD survivals) / (draft_ms(R) +
    verify_ms(T + B)), against a plain step's n_sampling / verify_ms(T). With measured step costs
    (step_costs.MeasuredStepCosts), once both kinds of step were measured at this batch-size
    bucket: the tokens per request per ms each kind really made there. Old confidences and past
    steps only, so the choice never depends on a current draft (lossless).

    Probes keep both measurements fresh. Every `probe_interval`-th step without drafts drafts
    anyway (refreshing the confidences, which would otherwise stay as old as the last drafted step,
    and the drafting rate). A probe costs a drafting step where plain ones pay better (at 256
    requests of the Qwen3-0.6B shape on the H200, ~3x a plain step), so each probe after which the
    policy still skips doubles the interval, up to `probe_max`; a step that drafts because it
    pays, or a load that moved by more than 1.5x since the last decision, brings it back to
    `probe_every`. With measured costs, drafting steps are likewise interrupted by a plain probe
    of PLAIN_PROBE_STEPS steps every `plain_probe_interval` drafting decisions (doubling while
    drafting still wins after one), so a bucket where drafting looked better from the start still
    learns what plain steps make there.

    Step timing (step_costs.py): the engine calls step_started() at the start of every step; a
    step this policy planned (plan, step_budget, a skip in should_draft, plan_plain) is measured
    from its start to the next step's start, with the tokens it emitted (plan_plain's, or
    step_tokens after a drafting step). The pipelined engine, which asks should_draft every step,
    never calls step_started: it reads planned_step_kind() after each launch and times the step
    itself, from the previous step's results to its own (LLMEngine._time_spec_step).

    Under async scheduling (LLMEngine._adaptive_async_step) a step should_draft skips runs as an
    async plain step, and so do the steps after it, without asking again (plain_step_done counts
    them), until a probe drafts; the probe's confidences and time then decide the next step."""

    # a plain probe's steps: under async scheduling without the graphs the first after a drafting
    # step is not timed (its GPU time is waited for in the next), the last not either (the drafting
    # step after it waits for it), so 4 give two measured plain steps; pipelined, all 4 are timed
    PLAIN_PROBE_STEPS = 4
    # a drafting step is measured when at least this share of its requests' draft slots is free
    # (not capped by max_tokens or max_model_len): see _slots_mostly_free
    MIN_SLOT_SHARE = 0.75

    def __init__(self, cost_model, k: int, ema_alpha: float | None = None, probe_every: int = 16,
                 overhead=None, step_costs=None, probe_max: int | None = None, correction=None,
                 on_step_cost=None, unobserved: str | None = None, mixed_steps: str = "separate"):
        from adaspec.spec_decode.step_overhead import OverheadCost, StepOverhead

        # overhead (step_overhead.StepOverhead): what a step costs beyond the tables, added to
        # every candidate; the default 0 prices the tables alone
        self.overhead = overhead if overhead is not None else StepOverhead(0.0)
        self.tables = cost_model  # what the tables say, to measure the overhead against
        # on_step_cost(R, base_tokens, B, priced_ms, wall_ms) after each drafting step this policy
        # planned (engine.stats.record_step_cost: the tables checked against the served steps)
        self.on_step_cost = on_step_cost
        self._price_memo: dict[tuple, float] = {}  # planned step shape -> _priced_ms
        self.cost = OverheadCost(cost_model, self.overhead)
        self.step_costs = step_costs  # step_costs.MeasuredStepCosts, or None: the tables decide
        # unobserved (config adaptive_verification_unobserved_confidence): what a request no step
        # drafted for counts as; None: the population's with measured step costs or fused mixed
        # steps (whose plain steps leave new requests unobserved for long), else 1.0 as vLLM
        if unobserved is None:
            unobserved = "population" if step_costs is not None or mixed_steps == "fused" else "one"
        self.budget = AdaptiveBudget(self.cost, k, ema_alpha=ema_alpha, unknown=unobserved, correction=correction)
        # config adaptive_verification_mixed_steps: "fused" judges a step that carries prompt chunks
        # at the margin (mixed_step_drafts), and the engine runs its plain choice as one forward
        if mixed_steps not in ("separate", "fused"):
            raise ValueError(f"mixed_steps must be 'separate' or 'fused', got {mixed_steps!r}")
        self.mixed_steps = mixed_steps
        self.probe_every = probe_every
        self.probe_max = max(probe_every, probe_max if probe_max is not None else 16 * probe_every)
        self.probe_interval = probe_every  # steps between probes now (probe_every .. probe_max)
        self.plain_probe_interval = probe_every  # drafting decisions between plain probes (measured costs)
        self._after_probe = False  # the last step was a probe: the next decision may lengthen the interval
        self._after_plain_probe = False  # likewise after a plain probe
        self._plain_probe_left = 0  # steps of the running plain probe still to come
        self._decided_requests: int | None = None  # requests of the step should_draft last decided for
        self.skipped_in_a_row = 0
        self.drafted_in_a_row = 0
        # (B*, draft width) found by should_draft, reused by step_budget / plan this step
        self._budget_now: tuple[int, int] | None = None
        self._width_now: int | None = None  # the width chosen with step_budget's B*, for draft_width
        # (requests, base tokens, B or None: no drafts, draft width: slots per request drafted)
        self._planned: tuple[int, int, int | None, int] | None = None
        self._probe_next = False  # plain_step_done announced a probe: the next should_draft drafts
        self._started: float | None = None  # when the running step started (step_started)
        self._open: list | None = None  # [kind, requests, start, tokens or None] of the step being timed
        self._costed: tuple[str, int] | None = None  # (kind, requests) of a planned step to measure
        self._decided_by_rates = False  # the last decision compared measured rates (not the tables)
        # (kind, bucket) -> (steps explored ahead of schedule, step_costs.num_observed at the first)
        self._explored: dict[tuple[str, int], tuple[int, int]] = {}
        self._narrow_steps = 0  # draft_width calls, for the full-width refresh (FULL_WIDTH_EVERY)

    def _priced_ms(self, num_requests: int, base_tokens: int, budget: int | None, width: int) -> float:
        """What the tables say a step of this shape costs (drafting `width` slots per request when
        budget is not None)."""
        ms = float(np.ravel(step_verify_ms(self.tables, num_requests, base_tokens + (budget or 0)))[0])
        return ms + (float(step_draft_ms(self.tables, num_requests, np.array([width]))[0]) if budget is not None else 0.0)

    def _plan_step(self, num_requests: int, base_tokens: int, budget: int | None, timed: bool = True,
                   tokens: int | None = None, whole: bool = True) -> None:
        """whole=False: these rows are one part of a step split in two forwards, whose wall holds
        the other part's too: neither timed for the step costs nor priced for the overhead and the
        cost check (observe_step), which would charge the other forward to this part's shape."""
        self._planned = (num_requests, base_tokens, budget, self.budget.k) if whole else None
        self._open = self._costed = None
        if not whole:
            return
        # decode steps only: a step with prefill chunks emits few tokens for its time whichever kind
        # it is, and the two kinds meet them in different phases (in H200 run 11 the plain steps
        # measured at 128-255 requests were mostly the ramp's, so drafting looked 2-3x better there)
        if self.step_costs is not None and timed and base_tokens <= num_requests:
            self._costed = (DRAFT if budget is not None else PLAIN, num_requests)
            if self._started is not None:  # timed here (step_started); else by the engine (planned_step_kind)
                self._open = [*self._costed, self._started, tokens]

    def planned_step_kind(self) -> tuple[str, int] | None:
        """(kind, requests) of the step planned last when its cost is one to measure (measured step
        costs on; a whole decode-only step; drafting: its slots mostly free), for an engine that
        times its steps itself: the pipelined one, which knows a step's wall and tokens only once
        the next step was launched (LLMEngine._time_spec_step). None otherwise; cleared when read."""
        costed, self._costed = self._costed, None
        return costed

    def step_tokens(self, tokens: int) -> None:
        """The step being timed emitted `tokens` (a drafting step reports them once read back)."""
        if self._open is not None:
            self._open[3] = tokens

    def step_started(self, now_s: float, measure_previous: bool = True) -> None:
        """A step starts at now_s (seconds, any monotonic clock): the step planned before it ends
        here. measure_previous=False drops it (the engine waited for it inside this step, e.g. to
        read back a step in flight before drafting: its interval would miss that wait)."""
        if self._open is not None and measure_previous and self._open[3] is not None:
            kind, r, t0, tokens = self._open
            self.step_costs.observe(kind, r, 1e3 * (now_s - t0), tokens)
        self._open = None
        self._started = now_s

    def idle(self) -> None:
        """No step ran (nothing scheduled): the next interval is not a step's."""
        self._open, self._started = None, None

    def plan_plain(self, num_requests: int, base_tokens: int, timed: bool = True, tokens: int | None = None) -> None:
        """The engine runs a step without drafts on its own (asynchronously), emitting `tokens`
        (its sampling rows; None: num_requests). timed=False: do not measure it (the first of a
        run: its GPU time is waited for in the next step)."""
        self._plan_step(num_requests, base_tokens, None, timed, num_requests if tokens is None else tokens)

    def observe_step(self, wall_ms: float) -> None:
        """The step this policy planned took wall_ms (host and GPU, all of it): update the
        overhead against what the tables priced it at. Steps it did not plan are ignored."""
        planned, self._planned = self._planned, None
        if planned is None:
            return
        priced = None
        if self.on_step_cost is not None and planned[2] is not None:
            priced = self._price_memo.get(planned)
            if priced is None:  # the tables never change and the shapes repeat: price each once
                if len(self._price_memo) >= 4096:
                    self._price_memo.clear()
                priced = self._price_memo[planned] = self._priced_ms(*planned)
            self.on_step_cost(planned[0], planned[1], planned[2], priced, wall_ms)
        if not self.overhead.measured:  # a fixed overhead: nothing to learn here
            return
        self.overhead.observe(wall_ms, self._priced_ms(*planned) if priced is None else priced)

    def measured_decode_rate(self, num_requests: int) -> float | None:
        """Tokens per ms that decode-only steps of the better measured kind made at this batch-size
        bucket (step_costs: tokens per request per ms, times the requests), or None: step costs are
        not measured, or neither kind is measured there yet (the tables' rate stands in)."""
        if self.step_costs is None:
            return None
        rates = [x for x in (self.step_costs.rate(DRAFT, num_requests), self.step_costs.rate(PLAIN, num_requests))
                 if x is not None]
        return max(rates) * num_requests if rates else None

    def _draft_pays(self, request_ids, n_sampling, base_tokens, limits, prefill_tokens: int = 0,
                    prefill_apart: bool = False) -> tuple[bool, int, int]:
        """(drafting beats a plain step, B* and its draft width if it drafts), from old survivals and the tables, or
        from the measured rates of both kinds where there are some (decode-only steps: a step
        with prompt chunks under mixed_steps "fused" is judged by mixed_step_drafts)."""
        r = len(request_ids)
        a = survival(self.budget.old_confidences(request_ids))
        a = np.where(np.arange(a.shape[1])[None, :] < np.asarray(limits)[:, None], a, 0.0)
        if self.mixed_steps == "fused" and prefill_tokens > 0:
            self._decided_by_rates = False
            decode_tokens = base_tokens if prefill_apart else base_tokens - prefill_tokens
            terms = mixed_step_terms(a, n_sampling, decode_tokens, prefill_tokens, r, self.cost, prefill_apart,
                                     self.measured_decode_rate(r))
            return terms.drafts, terms.budget, terms.width or a.shape[1]
        objective, widths, _ = width_capped_objective(a, n_sampling, base_tokens, r, self.cost)
        # the same objective choose_budget maximizes (same old survivals, limits, step shape):
        # keep its argmax (first maximum = ties to the smaller B) so plan need not search again
        b = int(np.argmax(objective))
        if self.step_costs is not None:
            drafting, plain = self.step_costs.rate(DRAFT, r), self.step_costs.rate(PLAIN, r)
            self._decided_by_rates = drafting is not None and plain is not None
            if self._decided_by_rates:
                return drafting >= plain, b, int(widths[b])
        plain_ms = float(np.ravel(step_verify_ms(self.cost, r, base_tokens))[0])
        return float(objective[b]) > n_sampling / max(plain_ms, 1e-12), b, int(widths[b])

    def _probe_due(self) -> bool:
        if self._probe_next:  # plain_step_done announced a probe for this step
            self._probe_next = False
        elif self.skipped_in_a_row + 1 >= self.probe_interval:
            self.skipped_in_a_row = 0
        else:
            return False
        self._after_probe = True
        return True

    def should_draft(self, request_ids, n_sampling, base_tokens, limits, prefill_tokens: int = 0,
                     prefill_apart: bool = False) -> bool:
        """Whether the step about to run drafts (when not, it is planned as a plain step).
        base_tokens: the query tokens of the forward the drafts would be verified in;
        prefill_tokens: the step's prompt-chunk tokens, counted in base_tokens unless prefill_apart
        (they run as a forward of their own)."""
        self._budget_now = None
        if self.mixed_steps == "fused" and prefill_tokens > 0 and self._plain_probe_left == 0:
            # a step with prompt chunks, judged at the margin (mixed_step_drafts): the probes'
            # schedule, kept for runs of steps the decode tables skip, neither counts nor forces it
            pays, b, w = self._draft_pays(request_ids, n_sampling, base_tokens, limits, prefill_tokens, prefill_apart)
            if pays:
                self._budget_now = (b, w)
                return True
            return self._skip(request_ids, base_tokens, n_sampling, probe=True)
        if self._plain_probe_left > 0:  # a plain probe's steps, where the engine asks every step
            self._plain_probe_left -= 1
            return self._skip(request_ids, base_tokens, n_sampling, probe=True)
        if self._probe_due():
            return True
        self._decided_requests = len(request_ids)
        after_probe, self._after_probe = self._after_probe, False
        after_plain_probe, self._after_plain_probe = self._after_plain_probe, False
        pays, b, w = self._draft_pays(request_ids, n_sampling, base_tokens, limits, prefill_tokens, prefill_apart)
        if pays:
            self._budget_now = (b, w)
            self.skipped_in_a_row = 0
            self.probe_interval = self.probe_every
            if after_plain_probe:  # drafting still wins: look at plain steps less often
                self.plain_probe_interval = min(2 * self.plain_probe_interval, self.probe_max)
            self.drafted_in_a_row += 1
            if self.step_costs is not None and (self.drafted_in_a_row >= self.plain_probe_interval
                                                or self._explore(PLAIN, len(request_ids))):
                self.drafted_in_a_row = 0
                self._budget_now = None
                self._after_plain_probe = True
                self._plain_probe_left = self.PLAIN_PROBE_STEPS - 1
                return self._skip(request_ids, base_tokens, n_sampling, probe=True)
            return True
        if self._explore(DRAFT, len(request_ids)):
            self.skipped_in_a_row = 0  # a drafting probe, ahead of the schedule
            self._after_probe = True
            return True
        if after_probe:  # the probe's fresh confidences and times still say skip: probe less often
            self.probe_interval = min(2 * self.probe_interval, self.probe_max)
        self.plain_probe_interval = self.probe_every
        return self._skip(request_ids, base_tokens, n_sampling)

    def _explore_due(self, kind: str, num_requests: int) -> bool:
        """Whether to run a step of `kind` now, ahead of the probe schedule, because that kind was
        not measured yet at this batch-size bucket while the other kind was: the first decisions
        there come from the tables, and waiting for the scheduled probe (16 or more steps) would
        spend a short request's life on the kind the tables favour. Each kind is explored at most
        once per bucket for plain (one plain probe) and min_samples times for drafting (one timed
        step each), so steps that are never timed cannot loop."""
        if self.step_costs is None:
            return False
        costs = self.step_costs
        other = DRAFT if kind == PLAIN else PLAIN
        # the first decision at a bucket is the tables' (it measures the kind they favour)
        if costs.rate(kind, num_requests) is not None or not costs.count(other, num_requests):
            return False
        return self._explorations(kind, num_requests)[0] < (1 if kind == PLAIN else costs.min_samples)

    def _explorations(self, kind: str, num_requests: int) -> tuple[int, int]:
        """(steps of `kind` explored at this bucket, step_costs.num_observed at the first of them);
        (0, now) once that first one is older than max_age (the rate may have gone stale since)."""
        now = self.step_costs.num_observed
        tried, since = self._explored.get((kind, self.step_costs.bucket(num_requests)), (0, now))
        return (tried, since) if now - since <= self.step_costs.max_age else (0, now)

    def _explore(self, kind: str, num_requests: int) -> bool:
        """_explore_due, counting the exploration when it is."""
        if not self._explore_due(kind, num_requests):
            return False
        tried, since = self._explorations(kind, num_requests)
        self._explored[(kind, self.step_costs.bucket(num_requests))] = (tried + 1, since)
        return True

    def _skip(self, request_ids, base_tokens, n_sampling, probe: bool = False) -> bool:
        """Plan this step without drafts; probe: a plain probe's step, not counted toward the
        drafting probes (those are for runs of plain steps the policy chose)."""
        self.drafted_in_a_row = 0
        if not probe:
            self.skipped_in_a_row += 1
        # the step's rows: request_ids are those with draft slots, and a row without any (its
        # max_tokens near) still samples in it; counted by request_ids alone, a decode-only step
        # with such a row would look like one with more tokens than requests and go unmeasured
        self._plan_step(max(len(request_ids), n_sampling), base_tokens, None, tokens=n_sampling)
        return False

    def plain_step_done(self, num_requests: int | None = None) -> bool:
        """The engine ran a plain step of num_requests on its own (async scheduling, after a step
        this policy skipped): count it toward the next probe. -> whether the next step should ask
        should_draft again: at a probe (which then drafts whatever the survivals say), at the end
        of a plain probe, once drafting is due to be explored at this bucket (_explore_due) or both
        kinds are measured there after the tables decided, or when the load moved by more than 1.5x
        since the last decision (which decides afresh, and probes at the shortest interval again)."""
        if self._plain_probe_left > 0:
            self._plain_probe_left -= 1
            return self._plain_probe_left == 0
        self.skipped_in_a_row += 1
        if num_requests is not None and self.step_costs is not None:
            if self._explore_due(DRAFT, num_requests):
                return True  # plain steps are measured here now, drafting is not: should_draft explores it
            if not self._decided_by_rates and all(self.step_costs.rate(kind, num_requests) is not None
                                                  for kind in (DRAFT, PLAIN)):
                return True  # the skip came from the tables, and both kinds are measured here now
        ref = self._decided_requests
        if num_requests is not None and ref and not ref / 1.5 <= num_requests <= 1.5 * ref:
            self.probe_interval = self.probe_every
            return True
        if self.skipped_in_a_row + 1 >= self.probe_interval:
            self.skipped_in_a_row = 0
            self._probe_next = True
            return True
        return False

    def draft_width(self, request_ids, budget: int, limits, widths: Sequence[int]) -> int:
        """The slots per request this step drafts, one of `widths` (ascending, the last = k): the
        width step_budget chose with `budget` (width_capped_objective: the step caps every request
        at it); for a budget it did not choose, the fewest that hold every request's share of
        `budget` when it is allocated by the stored (old) confidences, as the budget was. Either
        way a cap that depends on no current draft (lossless), so the step drafts only the slots it
        can verify. The allocation by the current confidences may then give a request fewer."""
        planned, self._width_now = self._width_now, None
        if planned is not None:
            need = planned
        else:
            a = survival(self.budget.old_confidences(request_ids))
            a = np.where(np.arange(a.shape[1])[None, :] < np.asarray(limits)[:, None], a, 0.0)
            useful = min(int(budget), int((a > 0).sum()))  # slots of survival 0 add nothing
            need = int(allocate(a, useful, limits).max()) if len(request_ids) else 0
        width = next((w for w in widths if w >= need), widths[-1])
        if self._refresh_due():  # now and then the whole block, so that slots past the width are seen again
            width = widths[-1]
        if self._planned is not None:  # step_budget planned this step: it drafts `width` slots
            self._planned = self._planned[:3] + (width,)
        return width

    # a narrow-drafting policy drafts every slot once per this many narrow-capable steps: the stored
    # confidences of slots past the width change only when drafted, and a low one would otherwise
    # keep the width narrow, and itself stale, for the rest of the request
    FULL_WIDTH_EVERY = 16

    def _refresh_due(self) -> bool:
        self._narrow_steps += 1
        return self._narrow_steps % self.FULL_WIDTH_EVERY == 0

    def step_budget(self, request_ids, n_sampling, base_tokens, limits, whole: bool = True) -> int:
        """B* for this step from the stored (old) confidences only, before any draft exists: the
        graphed step allocates it on the device (allocate_torch) without reading drafts back.
        whole=False: the rows are one part of a step split in two forwards (_plan_step)."""
        planned, self._budget_now = self._budget_now, None
        if planned is None:
            b = self.budget.budget(request_ids, n_sampling, base_tokens, limits=limits)
            self._width_now = self.budget.last_width
        else:
            b, self._width_now = planned
        self.budget.last_budget = b
        self._plan_step(len(request_ids), base_tokens, b, timed=self._slots_mostly_free(limits), whole=whole)
        return b

    def plan(self, request_ids, conf, n_sampling, base_tokens, limits, whole: bool = True):
        """The verify lengths for this step's drafts (by their confidences); whole as step_budget."""
        planned, self._budget_now = self._budget_now, None
        if planned is None:
            lengths = self.budget.plan(request_ids, conf, n_sampling, base_tokens, limits=limits).astype(np.int64)
        else:
            b = self.budget.last_budget = planned[0]
            lengths = allocate(survival(conf), b, limits).astype(np.int64)
        self._plan_step(len(request_ids), base_tokens, int(self.budget.last_budget),
                        timed=self._slots_mostly_free(limits), whole=whole)
        return lengths

    def _slots_mostly_free(self, limits) -> bool:
        """Whether a drafting step with these per-request slot limits is one to measure: at least
        MIN_SLOT_SHARE of the k draft slots per request free. Requests near max_tokens get few
        slots, so such a step yields few tokens whichever batch it runs in; measured, it stood for
        the whole bucket (H200 run 12: the benchmark's warm-up, requests of 8 tokens, made drafting
        at 64-127 requests look worse than plain steps just before a point where it made 1.4x)."""
        limits = np.asarray(limits)
        return limits.size > 0 and float(limits.sum()) >= self.MIN_SLOT_SHARE * self.budget.k * limits.size

    def observe(self, request_ids, conf) -> None:
        self.budget.observe(request_ids, conf)

    def forget(self, request_id) -> None:
        self.budget.forget(request_id)

    def observe_outcomes(self, verify_lens, accepted, survivals) -> None:
        """A step's verified drafts and how many the target accepted, with the survivals predicted
        for them: the online calibration's evidence (when it is on)."""
        if self.budget.correction is not None:
            self.budget.correction.update(verify_lens, accepted, survivals)
