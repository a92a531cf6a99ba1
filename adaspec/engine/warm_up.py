"""Dummy requests through the real step path at startup, so that what compiles at a first use
compiles before the engine reports ready, not inside the first requests a user sends.

On CUDA the pointwise ops and the samplers' hash are torch.compile'd with dynamic shapes, which
still specialize a dimension of size 1 (and Dynamo recompiles when a call's argument structure is
new). The graphs' capture compiles what the graphs run, and targeted warm-ups cover known eager
shapes (runner.warm_up, SpeculativeDecoder._warm_up_context); the rest was found on the H200 the
hard way: in H200 run 25 the adaptive arm's first served step, one 71-token prompt alone after 8
prompts together, took 701 ms with no Triton kernel compiled, against ~4 ms for the steps after it
(``ADASPEC_LOG_SLOW_STEPS_MS``, engine/slow_steps.py), and every adaptive arm's first point in runs
13-24 was slow by 0.1-0.7 s. Rather than chase each shape, the engine serves the shapes traffic
makes: one request alone and several together, greedy, sampled and both in one step, a request
joined by others while it decodes (steps mixing decodes with prefill chunks), and rows with
logprobs, top-k / top-p or a logits rule (whose part of a graphed step is redone eagerly after
the replay: spec_decode/graphed_extras.py). It also builds structured outputs' view of the vocabulary.

Afterwards the engine forgets them: its counters start from zero and the speculative policy is
built afresh (nothing it learned from dummy tokens, e.g. the online calibration or measured step
costs, survives). Every request has a seed of its own, so the engine's draws of seeds for
unseeded requests are the same with and without the warm-up.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from adaspec.sampling_params import SamplingParams

log = logging.getLogger("adaspec.engine")
MAX_STEPS = 10_000  # a warm-up that has not finished by then is a bug, not a slow machine


@dataclass
class WarmUpResult:
    requests: int
    steps: int
    seconds: float


def _prompt(n: int, length: int, vocab: int) -> list[int]:
    """A deterministic prompt of token ids in [1, vocab), different for each n."""
    return [(n * 7919 + i * 104729) % (vocab - 1) + 1 for i in range(length)]


def _phases(max_tokens: int) -> list[tuple[list[SamplingParams], int]]:
    """(requests' params, steps before the second half of them joins; 0: all at once)."""
    def p(temperature: float, **kw) -> SamplingParams:
        return SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, **kw)

    return [
        ([p(1.0)], 0),  # one request alone: sampled, then greedy
        ([p(0.0)], 0),
        ([p(1.0) for _ in range(3)], 0),  # several together
        ([p(0.0) for _ in range(3)], 0),
        ([p(0.0), p(1.0)], 0),  # greedy and sampled rows in one step
        ([p(1.0) for _ in range(4)], 2),  # one decodes, then others' prefill chunks join it
        ([p(0.0) for _ in range(4)], 2),
        ([p(1.0, logprobs=1)], 0),  # rows redone after the graphs' replay (graphed_extras.py)
        ([p(1.0, top_p=0.9, top_k=20) for _ in range(2)], 0),
        ([p(1.0, repetition_penalty=1.1), p(0.0, presence_penalty=0.5)], 0),  # ruled rows, redone likewise
    ]


def warm_up_serving(engine) -> WarmUpResult:
    """Run the phases' dummy requests to completion through engine.step(), then reset what they
    left behind (counters, the speculative policy). The engine must hold no requests."""
    if engine.has_unfinished_requests():
        raise RuntimeError("warm_up_serving needs an idle engine: it would reset its counters under live requests")
    t0 = time.perf_counter()
    k = engine.spec.num_spec_tokens if engine.spec is not None else 0
    max_tokens = k + 4  # enough tokens after the first for a step that verifies all k drafts
    vocab = engine.model_config.vocab_size
    length = max(1, min(40, engine.max_model_len - max_tokens - k - 1))
    n = steps = 0
    for params, join_after in _phases(max_tokens):
        requests = []
        for sp in params:
            sp.seed = 1_000_003 * (n + 1)  # its own seed: the engine's seed draws stay untouched
            requests.append((f"warm-up-{n}", _prompt(n, length, vocab), sp))
            n += 1
        pending = requests[1:] if join_after else []
        for r in requests[:1] if join_after else requests:
            engine.add_request(*r)
        phase_steps = 0
        # has_unfinished_requests also counts a step still in flight (async scheduling), so each
        # phase ends with everything read back
        while engine.has_unfinished_requests() or pending:
            if pending and phase_steps >= join_after:
                for r in pending:
                    engine.add_request(*r)
                pending = []
            engine.step()
            phase_steps += 1
            steps += 1
            if steps > MAX_STEPS:
                raise RuntimeError(f"the startup warm-up did not finish in {MAX_STEPS} steps")
    _build_grammar_tokenizer(engine)
    _forget(engine)
    return WarmUpResult(requests=n, steps=steps, seconds=time.perf_counter() - t0)


def _build_grammar_tokenizer(engine) -> None:
    """llguidance's view of the tokenizer, made now (once per engine: 481 ms at a 152k vocabulary on
    the 2-core development machine, BENCHMARKS.md "The masks' host cost") rather than in the step
    that adds the first structured-outputs request, which every running request would wait for.
    (No constrained dummy request: structured outputs have not run on a GPU yet, and a warm-up that
    fails stops the engine from starting.) Where llguidance cannot read the tokenizer, constrained
    requests fail alone later, with the reason."""
    if engine.tokenizer is None or not engine.stop_checker.eos_token_ids:
        return
    from adaspec.sample.structured_outputs import grammar_tokenizer

    try:
        grammar_tokenizer(engine.tokenizer, engine.model_config.vocab_size, engine.stop_checker.eos_token_ids)
    except Exception as e:  # noqa: BLE001 - whatever it is, only constrained requests need it
        # str(e), not e: a handler that keeps the record (pytest's log capture, a memory handler)
        # would keep the exception, its traceback's frames and through them this engine alive
        log.warning("warm-up: llguidance cannot read this tokenizer (%s: %s); structured outputs will fail",
                    type(e).__name__, str(e))


def _forget(engine) -> None:
    """Counters from zero, a fresh speculative policy; the labels set at build time are kept."""
    from adaspec.engine.stats import EngineStats

    old = engine.stats
    engine.stats = EngineStats(synthetic_acceptance=old.synthetic_acceptance)
    engine.stats.ensure_positions(len(old.accepted_per_pos))
    engine.scheduler.num_preemptions = 0
    engine.num_result_waits = 0
    runner = engine.runner
    runner.num_graph_steps = runner.num_eager_steps = runner.num_split_steps = runner.num_mixed_graph_steps = 0
    if engine.spec is not None:
        engine.spec.forget_history()
