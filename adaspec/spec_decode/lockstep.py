"""Two speculative engines in lockstep, and why their seeded outputs part (tests and diagnostics).

The graphed speculative step must draw exactly what the eager step draws: the same keyed uniforms
(sample/random.py) against the same distributions. It cannot compute those distributions to the
last bit, though: the graph pads the batch, so its matmuls and attention reduce in another order,
and float32 probabilities then differ by ~1e-7. An inverse-CDF draw over a whole vocabulary flips
when its uniform lies that close to a CDF boundary, about once in 10^4 draws (a random 8000-token
softmax perturbed by one part in 10^7), and a seeded run makes thousands of draws (the drafter's
k per step, the accept tests, the one categorical draw). Exact token equality at T = 1 is
therefore the wrong test; a divergence is acceptable only where rounding can explain it.

`run_lockstep` steps an eager engine and a graphed one over the same requests. At each request's
first differing step it finds the decision that parted them, from both sides' drafts and accept
counts, and judges it on the eager side (which records its inputs): a draft drawn differently
within the verified prefix (the DRAFT draw), else, when the two accepted different numbers of
drafts, the first accept test where they differ, else the categorical draw of the verification,
or the plain sampling of a request that did not draft. The margin of a decision is how far its
uniform lay from flipping it, as a fraction of the scale (for a draw: the distance of u * total to
the nearest CDF boundary over the total; for an accept test u < p(x)/q(x): |p/q - u| / max(p/q, u)).
A divergence is explained when that decision's margin is below `tol` (a near-tie); one with a wide
margin is a logic difference. Rounding flips measured 9e-9 (CPU) and 1e-8 to 3e-8 (H200); a wrong
seed, temperature or residual gives margins from 1e-5 up on the tiny pair's 8,000-token vocabulary,
hence the default of 1e-6. A plain draw of a top-k / top-p row is also judged by its filter: when
the cutoff itself lies within rounding (filter_margin), the two sides may keep different tokens
and their draws part at any margin (the verification's rows are judged by their draws only).

A plain engine's seeded draws part the same way (its graphed decode step samples inside sampling
graphs, engine/graphed_sampling.py): `draw_margin_after` judges any output token's draw by
replaying the request alone on the eager engine, the tokens before it as prompt, against the
engine's own token (`token_margin`: the engine sums in float32, and deep in the vocabulary its
cumulative sums lie ~1e-6 from float64's, so its token may be a rare neighbour of the float64
draw). H100 run 50: the plain graphed engine parted from the eager one at request 10's token 10,
in a cluster of rare tokens; on the CPU's probabilities the H100 eager token lies 5e-7 and the
graph's 8e-7 from the uniform, the CPU's own draw a third token at 4.8e-7.

The two engines must schedule alike: keep the token budget wide enough that it never binds (the
graphed engine's draft slots are verified apart and take nothing from it, the eager engine's do:
engine/scheduler.py), or their prefill chunks differ and so do their steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from adaspec.sample.random import ACCEPT, DRAFT, SAMPLE, keyed_uniforms
from adaspec.sample.logits_rules import apply_logits_rules
from adaspec.spec_decode import step as step_module

NEAR_TIE = 1e-6  # default tol: rounding flips measured at 1e-8..3e-8 (module docstring)


def _inverse_cdf(weights: torch.Tensor, u: float) -> tuple[int, torch.Tensor, float]:
    """The inverse-CDF draw in float64 (the margin must not be rounding noise): (index, cum, u * total)."""
    cum = weights.double().cumsum(-1)
    t = u * float(cum[-1])
    return int(torch.searchsorted(cum, torch.tensor([t], dtype=torch.float64), right=True)[0]), cum, t


def draw_margin(weights: torch.Tensor, u: float) -> float:
    """How far u * total lies from the nearest CDF boundary of the inverse-CDF draw, / total."""
    idx, cum, t = _inverse_cdf(weights, u)
    total = float(cum[-1])
    if total <= 0:
        return float("inf")
    lo = float(cum[idx - 1]) if idx > 0 else 0.0
    hi = float(cum[min(idx, cum.shape[0] - 1)])
    return min(t - lo, hi - t) / total


def filter_margin(logits: torch.Tensor, temperature: float, top_p: float, top_k: int) -> float:
    """How near processed_probs' top-k / top-p filter came to keeping a different set of tokens
    (inf for a row without a filter), from the row's logits in float64: for top-k, the gap between
    the k-th and the next scaled logit over their magnitude (at least 1); for top-p, the least
    distance of a kept-or-dropped token's preceding sorted mass to top_p (the probabilities' own
    scale; the first token is always kept). Two engines whose float32 probabilities differ by
    rounding keep different tokens when this is a near-tie, and their draws may then part at any
    margin (the renormalized distribution moves by the mass of the token kept or dropped): H200
    run 40 saw a first token part at a draw margin of 4.5e-5; that request's cutoff lies 2.2e-7
    from 0.9 (tests/spec_decode/test_lockstep.py, on the CPU)."""
    V = logits.shape[-1]
    if temperature <= 0 or (top_p >= 1.0 and not 0 < top_k < V):
        return float("inf")
    s = (logits.double() / temperature).sort(descending=True).values
    k = top_k if 0 < top_k < V else V
    margins = [float("inf")]
    if k < V:  # the logits' rounding is relative to their size, and at least ~1e-7 of 1 near 0
        margins.append(abs(float(s[k - 1] - s[k])) / max(abs(float(s[k - 1])), abs(float(s[k])), 1.0))
    if top_p < 1.0 and k > 1:  # the first token is always kept: its preceding mass (0) decides nothing
        p = torch.softmax(s[:k], 0)
        margins.append(float(((p.cumsum(0) - p)[1:] - top_p).abs().min()))
    return min(margins)


def token_margin(weights: torch.Tensor, u: float, token: int) -> float:
    """How far u * total lies from drawing `token` otherwise than the float64 draw does, / total:
    where the float64 draw is `token`, its distance to the nearest boundary (draw_margin); where it
    is another token, its distance to `token`'s own CDF interval. An engine draws in float32 (on
    CUDA a Triton kernel with its own summation order), whose cumulative sums lie ~1e-6 from
    float64's deep in an 8,000-token vocabulary, so a uniform that close to a cluster of rare
    tokens can give the engine a neighbour of the float64 draw (H100 run 50: the eager engine
    4867, the CPU 4865, the graph 4863, all within 1.5e-6); a wrong seed or position lands the
    token's interval far from u * total."""
    _, cum, t = _inverse_cdf(weights, u)
    total = float(cum[-1])
    if total <= 0:
        return float("inf")
    lo = float(cum[token - 1]) if token > 0 else 0.0
    hi = float(cum[token])
    if lo <= t < hi:  # the float64 draw is `token`: its distance to the nearer boundary
        return min(t - lo, hi - t) / total
    return (lo - t if t < lo else t - hi) / total


def _plain_margin(s: dict, token: int | None = None) -> float:
    """A recorded plain draw's margin: its draw's (judged against the engine's token where given:
    token_margin), or its filter's where that is nearer a tie."""
    u = _u(s["seed"], s["pos"], SAMPLE)
    drawn = draw_margin(s["probs"], u) if token is None else token_margin(s["probs"], u, token)
    return min(drawn, filter_margin(s["logits"], *s["filters"]))


def accept_margin(p_x: float, q_x: float, u: float) -> float:
    """Margin of the accept test u < p(x) / q(x) (q = 1 for deterministic drafts)."""
    ratio = p_x / q_x if q_x > 0 else float("inf")
    return abs(ratio - u) / max(ratio, u, 1e-30)


@dataclass
class Divergence:
    request_id: str
    step: int
    index: int  # first differing output token
    decision: str  # "draft j", "accept j", "draw", "plain draw", or "unrecorded"
    margin: float
    eager_tokens: list[int] = field(default_factory=list)
    graphed_tokens: list[int] = field(default_factory=list)

    def explained(self, tol: float = NEAR_TIE) -> bool:
        return self.margin < tol


class _EagerTap:
    """Records the eager engine's draws of one step by request id: its proposals (drafts and q)
    and its rejection-sampling inputs (a speculative engine), and its plain samples (any engine:
    the plain step and the speculative step's rows that did not draft both sample through
    LLMEngine._sample_on_device)."""

    def __init__(self, engine):
        self.engine = engine
        self.proposals: dict[str, dict] = {}
        self.verify: dict[str, dict] = {}
        self.plain: dict[str, dict] = {}
        spec = engine.spec
        sample_on_device = engine._sample_on_device
        self._drafted_ids: list[str] = []

        def tap_sample(logits, seqs, batch=None, ruled=False):
            out = sample_on_device(logits, seqs, batch, ruled)
            if batch is None and all(s.params.greedy for s in seqs):
                return out
            rows = None if ruled else step_module.rows_of(seqs)
            ruled_logits = apply_logits_rules(logits, rows) if rows is not None else logits  # what was sampled
            if batch is None:
                batch = step_module.SamplingBatch.build([s.params for s in seqs], [s.seed for s in seqs], logits.device)
            probs = batch.probs(ruled_logits)
            for n, s in enumerate(seqs):
                sp = s.params
                self.plain[s.request_id] = dict(probs=probs[n].float().cpu(), seed=int(s.seed), pos=len(s.token_ids),
                                                logits=ruled_logits[n].float().cpu(),
                                                filters=(sp.temperature, sp.top_p, sp.top_k))
            return out

        engine._sample_on_device = tap_sample
        if spec is None:
            return
        propose, accept = spec.propose, spec._accept

        def tap_propose(seqs, anchor_ids, anchor_pos, *a, **kw):
            prop = propose(seqs, anchor_ids, anchor_pos, *a, **kw)
            for n, s in enumerate(seqs):
                self.proposals[s.request_id] = dict(tokens=prop.tokens[n].tolist(), q=prop.probs[n].float().cpu(),
                                                    anchor=int(anchor_pos[n]), seed=int(s.seed))
            return prop

        def tap_accept(scheduled, drafted, drafted_seqs, *a, **kw):
            self._drafted_ids = [s.request_id for s in drafted_seqs]  # recorded only while set
            try:
                return accept(scheduled, drafted, drafted_seqs, *a, **kw)
            finally:
                self._drafted_ids = []

        spec.propose, spec._accept = tap_propose, tap_accept

    def remove(self) -> None:
        taps = [(self.engine, "_sample_on_device")]
        if self.engine.spec is not None:
            taps += [(self.engine.spec, "propose"), (self.engine.spec, "_accept")]
        for obj, name in taps:
            obj.__dict__.pop(name, None)  # the instance attribute set above; the method shows again

    def rejection_sample(self, original):
        def tap(draft_tokens, num_verify, p, q, greedy, seeds, anchors, **kw):
            out = original(draft_tokens, num_verify, p, q, greedy, seeds, anchors, **kw)
            for n, rid in enumerate(self._drafted_ids):
                self.verify[rid] = dict(drafts=draft_tokens[n].tolist(), num_verify=int(num_verify[n]),
                                        n_acc=int(out.num_accepted[n]), p=p[n].float().cpu(),
                                        q=None if q is None else q[n].float().cpu(), seed=int(seeds[n]),
                                        anchor=int(anchors[n]))
            return out
        return tap

    def clear(self):
        self.proposals.clear()
        self.verify.clear()
        self.plain.clear()


def _u(seed: int, pos: int, stream: int, anchor: int | None = None) -> float:
    a = None if anchor is None else torch.tensor([anchor])
    return float(keyed_uniforms(torch.tensor([seed]), torch.tensor([pos]), stream, a)[0])


def _parting_decision(tap: _EagerTap, graphed_row: dict | None, rid: str) -> tuple[str, float]:
    """The decision that parted the two engines for request rid this step, judged by the eager
    side's inputs, and its margin. graphed_row: the graphed step's drafts and accepted count."""
    v = tap.verify.get(rid)
    prop = tap.proposals.get(rid)
    if v is not None and prop is not None and graphed_row is not None:
        nv, a, seed, n_e = v["num_verify"], v["anchor"], v["seed"], v["n_acc"]
        n_g = min(graphed_row["n_acc"], nv)
        # drafts matter up to the first rejection on either side (later ones were never judged)
        upto = min(max(n_e, n_g) + 1, nv)
        diff = [j for j in range(upto) if prop["tokens"][j] != graphed_row["drafts"][j]]
        if diff:  # a draft drawn differently: the drafter's DRAFT draw at slot j
            j = diff[0]
            return f"draft {j}", draw_margin(prop["q"][j], _u(seed, a + 1 + j, DRAFT, a))
        if n_e != n_g:  # the same drafts, a different verdict: the first accept test they disagree on
            j = min(n_e, n_g)
            x = v["drafts"][j]
            q_x = 1.0 if v["q"] is None else float(v["q"][j, x])
            return f"accept {j}", accept_margin(float(v["p"][j, x]), q_x, _u(seed, a + 1 + j, ACCEPT, a))
        dist = v["p"][n_e].double()  # same drafts, same verdicts: the one categorical draw
        if n_e < nv:  # rejected: the residual p - q
            q_stop = torch.zeros_like(dist)
            if v["q"] is None:
                q_stop[v["drafts"][n_e]] = 1.0
            else:
                q_stop = v["q"][n_e].double()
            res = (dist - q_stop).clamp_min(0.0)
            dist = res if float(res.sum()) > 0 else dist
        return "draw", draw_margin(dist, _u(seed, a + 1 + n_e, SAMPLE))
    s = tap.plain.get(rid)
    if s is not None and graphed_row is None:
        return "plain draw", _plain_margin(s)
    return "unrecorded", float("inf")


def run_lockstep(eager, graphed, requests) -> tuple[list[Divergence], int]:
    """Step both engines (LLMEngine, the same model and speculative config; `graphed` runs the
    graphed step) over requests [(request_id, prompt token ids, SamplingParams)] until both are
    done. -> (the divergences, each request's first only; requests compared)."""
    tap = _EagerTap(eager)
    rows: dict[str, dict] = {}  # this step's graphed rows that drafted: drafts, accepted drafts
    launch_graphed = graphed.spec._launch_graphed
    k = graphed.spec.num_spec_tokens

    def tap_graphed(scheduled, *a, **kw):
        finish = launch_graphed(scheduled, *a, **kw)

        def tapped_finish():
            out = finish()
            g = graphed.spec.graphed
            for i, sch in enumerate(scheduled):
                if sch.spec_slots > 0:  # rows without slots only sampled (their drafts were never judged)
                    rows[sch.seq.request_id] = dict(drafts=g.drafts[i].tolist(), n_acc=int(g.readback[i, k + 1]))
            return out

        return tapped_finish

    graphed.spec._launch_graphed = tap_graphed
    for rid, prompt, params in requests:
        eager.add_request(rid, prompt, params)
        graphed.add_request(rid, prompt, params)
    found: list[Divergence] = []
    parted: set[str] = set()
    original = step_module.rejection_sample
    step_module.rejection_sample = tap.rejection_sample(original)
    try:
        step = 0
        while eager.has_unfinished_requests() or graphed.has_unfinished_requests():
            step += 1
            tap.clear()
            rows.clear()
            want = {o.request_id: list(o.outputs[0].token_ids) for o in eager.step()}
            got = {o.request_id: list(o.outputs[0].token_ids) for o in graphed.step()}
            for rid in sorted(set(want) | set(got)):
                if rid in parted or want.get(rid) == got.get(rid):
                    continue
                parted.add(rid)
                a, b = want.get(rid) or [], got.get(rid) or []
                first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                decision, margin = _parting_decision(tap, rows.get(rid), rid)
                found.append(Divergence(rid, step, first, decision, margin, a[first:first + 3], b[first:first + 3]))
    finally:
        step_module.rejection_sample = original
        tap.remove()
        graphed.spec.__dict__.pop("_launch_graphed", None)
    return found, len(requests)


def first_draw_margin(eager, prompt: list[int], params) -> tuple[int | None, float]:
    """One request alone on an eager engine (LLMEngine, speculative or plain), its first token
    only: that token (the prefill's plain draw; None if it was a stop token) and the draw's margin
    (or its top-k / top-p filter's, where that is nearer a tie). Engines that batch a prefill
    differently (a pipelined engine prefills arrivals beside speculative rows, a synchronous one
    all at once) compute its probabilities only to within rounding, so a first token on which they
    differ is explained when this margin is a near-tie."""
    return draw_margin_after(eager, prompt, [], params)


def draw_margin_after(eager, prompt: list[int], generated: list[int], params) -> tuple[int | None, float]:
    """The draw of a request's output token number len(generated), after the tokens `generated`
    (which both engines produced alike), judged as first_draw_margin judges a first token: the
    request is run alone on the eager engine with prompt + generated as its prompt and one token
    to draw. The uniform is the same (keyed by the seed and the absolute position:
    sample/random.py) and the probabilities those of a prefill instead of a decode step, equal to
    within rounding, which is all a near-tie's margin asks. -> (the token drawn, its margin).

    Only for requests whose distribution does not depend on which tokens were output rather than
    prompted: presence / frequency penalties, min_tokens and structured outputs do, and are refused."""
    if params.presence_penalty or params.frequency_penalty or params.min_tokens > len(generated) \
            or params.structured_outputs is not None or params.guided_decoding is not None:
        raise ValueError("draw_margin_after replays the draw with the generated tokens as prompt: not for "
                         "requests with presence / frequency penalties, min_tokens or structured outputs")
    tap = _EagerTap(eager)
    rid = f"draw-after-{len(generated)}"
    token = None
    try:
        eager.add_request(rid, list(prompt) + list(generated),
                          replace(params, max_tokens=1, stop_token_ids=[], ignore_eos=True, min_tokens=0))
        while eager.has_unfinished_requests():
            for o in eager.step():
                if o.finished and o.outputs[0].token_ids:
                    token = int(o.outputs[0].token_ids[0])
    finally:
        tap.remove()
    s = tap.plain.get(rid)
    if s is None:
        return token, float("inf")
    if token is None:
        return token, float("inf")
    # judged against the engine's own token: how far the uniform lies from drawing it otherwise
    # (token_margin; a wrong position or stream lands it far away); a top-k / top-p row's filter
    # is judged too (filter_margin)
    return token, _plain_margin(s, token)
