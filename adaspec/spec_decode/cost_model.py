"""Step-cost tables measured at startup: verify cost by token count, draft cost by request count.

Lookup rules (VERIFY.md, "The cost model"), for a table with a capture limit L:
  * n <= L: the cost of the smallest profiled size >= n. A captured CUDA graph pads the batch
    up to its size, so the padding is paid: the curve is a step function there.
  * n > L: linear interpolation between profiled points ABOVE L only. Crossing L means losing
    graphs, a real jump, so we never interpolate across it. Between L and the first point
    above it we extend that first segment backwards, clamped to at least the cost at L.
  * past the last point: linear extrapolation from the last two points of the region.
With ``capture_limit=None`` (CPU, eager) the whole table is one interpolated region.
Tables are forced non-decreasing (running max): timing noise must not make the policy think
that a bigger batch is cheaper.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

CACHE_FORMAT = 1
DENSE_MAX = 1 << 17  # largest size with a precomputed per-integer lookup table


class CostTable:
    """Monotone cost curve over integer sizes (tokens or requests), lookups vectorized."""

    def __init__(self, sizes: Sequence[int], ms: Sequence[float], capture_limit: int | None = None):
        s = np.asarray(sizes, dtype=np.int64)
        m = np.asarray(ms, dtype=np.float64)
        if s.ndim != 1 or s.shape != m.shape or s.size == 0:
            raise ValueError("sizes and ms must be non-empty 1-D sequences of equal length")
        if np.any(s < 1) or not np.all(np.isfinite(m)) or np.any(m < 0):
            raise ValueError("sizes must be >= 1 and ms finite and >= 0")
        order = np.argsort(s, kind="stable")
        s, m = s[order], m[order]
        if np.any(np.diff(s) == 0):
            raise ValueError("duplicate sizes in cost table")
        self.sizes = s
        self.ms = np.maximum.accumulate(m)  # forced non-decreasing
        self.capture_limit = None if capture_limit is None else int(capture_limit)
        lim = self.capture_limit
        self._hi = np.ones_like(s, dtype=bool) if lim is None else s > lim
        # dense table for integer sizes: the policy looks up ~R*k sizes every step
        self._dense = self._lookup(np.arange(int(s[-1]) + 1)) if s[-1] <= DENSE_MAX else None

    # -- lookup -------------------------------------------------------------------------
    def __call__(self, n):
        return self.lookup(n)

    def lookup(self, n):
        """Cost in ms for size(s) ``n`` (scalar -> float, array -> float64 array). n <= 0 -> 0."""
        d = self._dense
        if d is not None:
            if isinstance(n, (int, np.integer)) and 0 <= n < d.size:
                return float(d[n])
            if isinstance(n, np.ndarray) and n.dtype.kind in "iu" and n.size and n.min() >= 0 and n.max() < d.size:
                return d[n]
        return self._lookup(n)

    def _lookup(self, n):
        arr = np.asarray(n, dtype=np.float64)
        out = np.zeros(arr.shape, dtype=np.float64)
        pos = arr > 0
        lim = self.capture_limit
        if lim is None:
            out[pos] = self._interp(arr[pos], self.sizes, self.ms)
        else:
            low = pos & (arr <= lim)
            high = pos & (arr > lim)
            if low.any():
                out[low] = self._step(arr[low])
            if high.any():
                floor = self._step(np.array([float(lim)]))[0]
                hs, hm = self.sizes[self._hi], self.ms[self._hi]
                if hs.size == 0:  # nothing profiled above the limit: scale the last point
                    out[high] = np.maximum(floor, self.ms[-1] * arr[high] / self.sizes[-1])
                else:
                    out[high] = np.maximum(floor, self._interp(arr[high], hs, hm, back=True))
        return float(out) if out.ndim == 0 else out

    def _step(self, x: np.ndarray) -> np.ndarray:
        idx = np.searchsorted(self.sizes, np.ceil(x), side="left")
        over = idx >= self.sizes.size
        res = self.ms[np.minimum(idx, self.sizes.size - 1)]
        if over.any():  # limit above the last profiled size: proportional scaling
            res = np.where(over, self.ms[-1] * x / self.sizes[-1], res)
        return res

    @staticmethod
    def _interp(x: np.ndarray, s: np.ndarray, m: np.ndarray, back: bool = False) -> np.ndarray:
        s = s.astype(np.float64)
        if s.size == 1:
            return np.full(x.shape, m[0])
        res = np.interp(x, s, m)  # clamps outside [s0, s_last]
        slope_hi = (m[-1] - m[-2]) / (s[-1] - s[-2])
        res = np.where(x > s[-1], m[-1] + slope_hi * (x - s[-1]), res)
        if back:  # between the capture limit and the first point above it
            slope_lo = (m[1] - m[0]) / (s[1] - s[0])
            res = np.where(x < s[0], m[0] - slope_lo * (s[0] - x), res)
        return res

    # -- (de)serialization --------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"sizes": self.sizes.tolist(), "ms": self.ms.tolist(), "capture_limit": self.capture_limit}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CostTable":
        return cls(d["sizes"], d["ms"], d.get("capture_limit"))

    def __repr__(self) -> str:
        return f"CostTable(n={self.sizes.size}, max={int(self.sizes[-1])}, capture_limit={self.capture_limit})"


@dataclass
class CostModel:
    verify: CostTable  # by number of tokens in the target forward
    draft: CostTable  # by number of requests drafting, all k slots (the full draft)
    # narrower drafts (adaptive_draft_width "budget"): draft width -> cost by requests, for the widths
    # below k that the graphed step captured; empty: every draft is priced as the full one
    draft_narrow: dict[int, CostTable] = field(default_factory=dict)
    # the captured verify graphs, timed one by one: query tokens a request (the graph's level) ->
    # cost by the graph's rows (requests). `verify` times n tokens as n / (k + 1) rows of k + 1, so a
    # step of fewer tokens a row (more rows for its tokens) pays per-row work (each row's context
    # read by attention, its sampling) that the token table prices at fewer rows; graphed_step.
    # GraphPaddedCost prices a graphed step from these when they hold its graph. Empty: no graphs.
    verify_graph: dict[int, CostTable] = field(default_factory=dict)

    def verify_ms(self, n_tokens):
        return self.verify.lookup(n_tokens)

    def draft_ms(self, n_requests):
        return self.draft.lookup(n_requests)

    @property
    def prices_widths(self) -> bool:
        return bool(self.draft_narrow)

    def draft_ms_width(self, n_requests: int, need) -> np.ndarray:
        """The draft cost of n_requests when the step must draft ``need`` slots per request (an
        array, e.g. one entry per candidate budget): the narrowest profiled width holding it, the
        full draft where none does."""
        need = np.asarray(need, dtype=np.int64)
        out = np.full(need.shape, float(self.draft.lookup(n_requests)))
        for w in sorted(self.draft_narrow, reverse=True):  # the narrowest that holds `need` ends up written
            out = np.where(need <= w, float(self.draft_narrow[w].lookup(n_requests)), out)
        return out

    def verify_graph_ms(self, rows: int, level: int) -> float | None:
        """What the verify graph of `rows` requests and `level` query tokens each costs, or None
        when the graph tables do not hold that level (then the token table prices it)."""
        t = self.verify_graph.get(int(level))
        return None if t is None else float(t.lookup(int(rows)))

    def to_dict(self) -> dict[str, Any]:
        d = {"verify": self.verify.to_dict(), "draft": self.draft.to_dict()}
        if self.draft_narrow:
            d["draft_narrow"] = {str(w): t.to_dict() for w, t in sorted(self.draft_narrow.items())}
        if self.verify_graph:
            d["verify_graph"] = {str(q): t.to_dict() for q, t in sorted(self.verify_graph.items())}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CostModel":
        narrow = {int(w): CostTable.from_dict(t) for w, t in (d.get("draft_narrow") or {}).items()}
        if any(w < 1 for w in narrow):
            raise ValueError(f"draft widths must be >= 1, got {sorted(narrow)}")
        graph = {int(q): CostTable.from_dict(t) for q, t in (d.get("verify_graph") or {}).items()}
        if any(q < 1 for q in graph):
            raise ValueError(f"verify graph levels (query tokens a request) must be >= 1, got {sorted(graph)}")
        return cls(CostTable.from_dict(d["verify"]), CostTable.from_dict(d["draft"]), narrow, graph)

    def tables(self) -> list[tuple[str, CostTable, str]]:
        """(name, table, unit) of every table, the narrow drafts after the full one, then the
        verify graphs by level."""
        out = [("verify", self.verify, "tokens"), ("draft", self.draft, "requests")]
        out += [(f"draft of {w} slots", t, "requests") for w, t in sorted(self.draft_narrow.items())]
        return out + [(f"verify graph of {q} tokens a request", t, "requests") for q, t in sorted(self.verify_graph.items())]

    def describe(self) -> str:
        """Human-readable tables (for ``adaspec profile``)."""
        lines = []
        for name, t, unit in self.tables():
            lines.append(f"{name} cost (capture limit: {t.capture_limit})")
            lines.append(f"  {unit:>10}  {'ms':>10}")
            lines += [f"  {int(s):>10}  {m:>10.3f}" for s, m in zip(t.sizes, t.ms)]
        return "\n".join(lines)


class WrappedCost:
    """A cost model seen through another (graphed_step.GraphPaddedCost, step_overhead.OverheadCost):
    drafts priced as the wrapped model prices them, its narrow-draft tables included; subclasses
    change how a verify forward is priced."""

    def __init__(self, cost: Any):
        self.cost = cost

    def draft_ms(self, n_requests):
        return self.cost.draft_ms(n_requests)

    @property
    def prices_widths(self) -> bool:
        return bool(getattr(self.cost, "prices_widths", False))

    def draft_ms_width(self, n_requests: int, need) -> np.ndarray:
        from adaspec.spec_decode.policy import step_draft_ms  # policy imports this module

        return step_draft_ms(self.cost, n_requests, need)

    def verify_ms(self, n_tokens):
        return self.cost.verify_ms(n_tokens)


# -- grids ----------------------------------------------------------------------------------
def _geometric(max_n: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, ... (x1.5 / x2 alternation) up to and including max_n."""
    out, n = {1}, 1
    while n < max_n:
        out.update({min(max_n, int(n * 1.5)), min(max_n, n * 2)})
        n *= 2
    return sorted(x for x in out if 1 <= x <= max_n)


def _grid(max_n: int, capture_sizes: Iterable[int] | None) -> list[int]:
    if max_n < 1:
        raise ValueError("grid maximum must be >= 1")
    if not capture_sizes:
        return _geometric(max_n)
    caps = sorted({int(c) for c in capture_sizes if 1 <= int(c) <= max_n})
    if not caps:
        return _geometric(max_n)
    out, n = list(caps), caps[-1]
    nxt = max(n + 1, int(n * 1.5))  # 1.5x, then doubling (VERIFY.md)
    while nxt < max_n:
        out.append(nxt)
        nxt *= 2
    if out[-1] < max_n:
        out.append(max_n)
    return out


def verify_grid(max_tokens: int, capture_sizes: Iterable[int] | None = None) -> list[int]:
    """Token counts to profile: capture sizes, then 1.5x the largest, then doubling up to
    ``max_tokens`` (max_num_batched_tokens, always included). No graphs: geometric grid."""
    return _grid(max_tokens, capture_sizes)


def draft_grid(max_requests: int, capture_sizes: Iterable[int] | None = None) -> list[int]:
    """Request counts to profile for drafting, same rules as :func:`verify_grid`."""
    return _grid(max_requests, capture_sizes)


def capture_limit_of(capture_sizes: Iterable[int] | None) -> int | None:
    caps = [int(c) for c in capture_sizes or ()]
    return max(caps) if caps else None


# -- profiling ------------------------------------------------------------------------------
def _time_table(fn, sizes, repeats, warmup, timer, sync, capture_limit) -> CostTable:
    """Every shape warmed up, then the repeats in rounds over all the shapes (not shape after
    shape): a drift of the device's speed while profiling (clocks, temperature) then moves every
    shape's runs alike, where shape after shape it would move the later shapes' whole tables; the
    policy decides on differences of ~0.1-0.3 ms between shapes. (H200 run 29: the verify tables of
    the adaptive:7 and adaptive-narrow:7 servers of one build differed by 0.07-0.28 ms, the narrow
    one's higher at every shape in three pairs of profiles, whichever arm started first: an offset
    between the arms that rounds cannot remove; whether drift within a ~0.2 s profile matters at
    all is what benchmarks/probes/cost_table_stability.py measures.)"""
    ms = _time_shapes(fn, [(n,) for n in sizes], repeats, warmup, timer, sync)
    return CostTable(sizes, [ms[(n,)] for n in sizes], capture_limit)


def _time_shapes(fn, shapes, repeats, warmup, timer, sync) -> dict[tuple, float]:
    """fn(*shape) for every shape, warmed up, then timed in rounds (_time_table): shape -> median ms."""
    for shape in shapes:
        for _ in range(warmup):
            fn(*shape)
    runs: dict[tuple, list[float]] = {shape: [] for shape in shapes}
    for _ in range(repeats):
        for shape in shapes:
            if sync is not None:
                sync()  # do not charge this shape for queued work of the previous one
            t0 = timer()
            fn(*shape)
            if sync is not None:
                sync()
            runs[shape].append((timer() - t0) * 1e3)
    return {shape: float(np.median(r)) for shape, r in runs.items()}


def graph_rows_grid(batch_sizes: Iterable[int]) -> list[int]:
    """The captured batch sizes whose verify graphs are timed: 1, 2, 4, 8 and then those nearest
    a x1.5 / x2 ladder (the rest are interpolated between them: a graph's cost grows smoothly with
    its rows, and every one of 8 query levels at every eighth batch size would triple the profile)."""
    caps = sorted({int(b) for b in batch_sizes if int(b) >= 1})
    if not caps:
        return []
    want = _geometric(caps[-1])
    out = {caps[-1]}
    for w in want:
        out.add(min(caps, key=lambda b: (abs(b - w), b)))
    return sorted(out)


def profile(
    fn_verify: Callable[[int], None],
    fn_draft: Callable[[int], None] | None,
    verify_sizes: Sequence[int],
    draft_sizes: Sequence[int],
    repeats: int = 5,
    warmup: int = 1,
    timer: Callable[[], float] = time.perf_counter,
    sync: Callable[[], None] | None = None,
    verify_capture_limit: int | None = None,
    draft_capture_limit: int | None = None,
    fn_draft_width: Callable[[int, int], None] | None = None,
    narrow_widths: Sequence[int] = (),
    fn_verify_graph: Callable[[int, int], None] | None = None,
    graph_shapes: Sequence[tuple[int, int]] = (),
) -> CostModel:
    """Time dummy steps; each shape's cost is the median of ``repeats`` runs (ms).

    ``sync`` (e.g. torch.cuda.synchronize) brackets every timed run so that asynchronous
    devices are measured, not just kernel launches. ``fn_draft=None`` gives a zero draft table.
    ``fn_draft_width(n, w)`` drafts w slots for n requests: timed over ``draft_sizes`` for every
    width in ``narrow_widths`` (those below k; ``fn_draft`` times the full width).
    ``fn_verify_graph(rows, q)`` replays the verify graph of `rows` requests of q query tokens:
    timed for every (rows, q) of ``graph_shapes`` into CostModel.verify_graph.
    """
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    verify = _time_table(fn_verify, list(verify_sizes), repeats, warmup, timer, sync, verify_capture_limit)
    graph = {}
    if graph_shapes:
        if fn_verify_graph is None:
            raise ValueError("graph_shapes given without fn_verify_graph")
        ms = _time_shapes(fn_verify_graph, [(int(b), int(q)) for b, q in graph_shapes], repeats, warmup, timer, sync)
        for q in sorted({q for _, q in ms}):
            rows = sorted(b for b, level in ms if level == q)
            graph[q] = CostTable(rows, [ms[(b, q)] for b in rows], None)
    if fn_draft is None:
        return CostModel(verify, CostTable([1], [0.0], None), verify_graph=graph)
    draft = _time_table(fn_draft, list(draft_sizes), repeats, warmup, timer, sync, draft_capture_limit)
    narrow = {}
    if narrow_widths and fn_draft_width is None:
        raise ValueError("narrow_widths given without fn_draft_width")
    for w in sorted({int(w) for w in narrow_widths}):
        narrow[w] = _time_table(lambda n, w=w: fn_draft_width(n, w), list(draft_sizes), repeats, warmup, timer,
                                sync, draft_capture_limit)
    return CostModel(verify, draft, narrow, graph)


# -- disk cache -----------------------------------------------------------------------------
def _normalize_key(key: dict[str, Any]) -> dict[str, Any]:
    # JSON round trip so that tuples/lists, ints/floats compare as they will after loading
    return json.loads(json.dumps(key, sort_keys=True, default=str))


def cache_path(cache_dir: str | os.PathLike, key: dict[str, Any]) -> str:
    blob = json.dumps(_normalize_key(key), sort_keys=True).encode()
    return os.path.join(os.fspath(cache_dir), f"cost_model_{hashlib.sha256(blob).hexdigest()[:20]}.json")


def default_cache_key(**fields: Any) -> dict[str, Any]:
    """Key dict with the adaspec version added; pass model, drafter, dtype, device name,
    engine limits, capture sizes, profiling context length, ... as keyword fields."""
    from adaspec import __version__

    return {"adaspec_version": __version__, **fields}


def _read_cached(path: str, key: dict[str, Any]) -> CostModel | None:
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        if doc.get("format") != CACHE_FORMAT:
            raise ValueError(f"format {doc.get('format')!r} != {CACHE_FORMAT}")
        if doc.get("key") != _normalize_key(key):
            raise ValueError("stored key does not match (stale cache)")
        return CostModel.from_dict(doc["model"])  # validates the tables
    except Exception as e:  # corrupt or stale: never trust, re-profile
        warnings.warn(f"ignoring cost-model cache {path}: {e}", RuntimeWarning, stacklevel=3)
        return None


def _write_atomic(path: str, doc: dict[str, Any]) -> None:
    d = os.path.dirname(path) or "."
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".cost_model_", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # readers see the old file or the new one, never a torn one
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_or_profile(cache_dir: str | os.PathLike, key: dict[str, Any], profile_fn: Callable[[], CostModel]) -> CostModel:
    """Cached cost model for ``key``, or ``profile_fn()`` stored under a hash of ``key``.

    The full key is stored in the file and compared on load; a corrupt, unreadable or stale
    file triggers a warning and a fresh profile. A failed write only warns.
    """
    path = cache_path(cache_dir, key)
    model = _read_cached(path, key)
    if model is not None:
        return model
    model = profile_fn()
    doc = {"format": CACHE_FORMAT, "key": _normalize_key(key), "model": model.to_dict()}
    try:
        _write_atomic(path, doc)
    except OSError as e:
        warnings.warn(f"could not write cost-model cache {path}: {e}", RuntimeWarning, stacklevel=2)
    return model


# -- plot -----------------------------------------------------------------------------------
def plot_cost_model(model: CostModel, path: str | os.PathLike) -> None:
    """Both curves (profiled points + lookup curve, capture limit dashed) into ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from adaspec.figures import save_png

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    by_axis = [[("verify", model.verify, "tokens")], [row for row in model.tables() if row[0] != "verify"]]
    for ax, rows in zip(axes, by_axis):
        for name, t, unit in rows:
            _plot_table(ax, name, t, unit, label=len(rows) > 1)
    fig.tight_layout()
    save_png(fig, path, dpi=120)
    plt.close(fig)


def _plot_table(ax, name: str, t: CostTable, unit: str, label: bool) -> None:
    """One table's lookup curve and profiled points; ``label``: several tables share the axis."""
    xs = np.arange(1, int(t.sizes[-1]) + 1)
    prefix = f"{name}: " if label else ""
    line, = ax.plot(xs, t.lookup(xs), lw=1, label=f"{prefix}lookup")
    ax.plot(t.sizes, t.ms, "o", ms=3, c=line.get_color(), label=f"{prefix}profiled (median)")
    if t.capture_limit is not None:
        ax.axvline(t.capture_limit, ls="--", c="gray", lw=1, label="capture limit")
    ax.set_xscale("log")
    ax.set_xlabel(unit)
    ax.set_ylabel("ms")
    ax.set_title("draft cost" if label else f"{name} cost")
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles))  # the capture limit once, however many tables drew it
    ax.legend(seen.values(), seen.keys(), fontsize="small")
