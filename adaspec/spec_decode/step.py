"""The speculative step: draft for every decoding request, verify all drafts in ONE packed
target forward (prefill chunks of other requests ride along), accept losslessly.

Flow of one step (VERIFY.md):
1. drafter.propose for requests that decode this step (anchor = their last token, whose
   position is the first uncomputed one; their context K/V was written by earlier steps);
2. the policy picks l_r (fixed: all reserved slots; adaptive: the confidence-scheduled budget);
3. one target forward: [last token, l_r drafts] per decoding request, chunks for the others,
   capturing the drafter's target layers;
4. rejection sampling (sample/rejection.py) on p and q processed by the same function;
5. KV: the target keeps positions up to the last accepted draft (num_computed_tokens moves,
   blocks beyond are given back); the drafter's context is written for every verified token.
The drafter cache shares the target's block tables, so its rollback is the same forgetting.
"""
from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable

import numpy as np
import torch

from adaspec.config import EngineConfig, SpeculativeConfig
from adaspec.engine.kv_cache import allocate_kv_caches, bytes_per_block
from adaspec.engine.runner import ForwardItem
from adaspec.engine.scheduler import ScheduledSeq
from adaspec.errors import ConfigError
from adaspec.h2d import to_device
from adaspec.models.registry import DEFAULT_DRAFTERS
from adaspec.sample.batch import SameRequestsCache, SamplingBatch, SamplingBatchCache
from adaspec.sample.logits_rules import draft_bias, logits_with_rules, rows_of
from adaspec.sample.probs import logprobs_of
from adaspec.sample.rejection import rejection_sample
from adaspec.sample.structured_outputs import grammar_reach
from adaspec.engine.async_step import InFlightStep
from adaspec.engine.prompt_logprobs import logits_rows, record as record_prompt_logprobs, sampling_logits
from adaspec.spec_decode.graphed_extras import RowExtras, add_logprobs
from adaspec.spec_decode.pipelined import InFlightSpecStep, carried_rows, pipelinable
from adaspec.spec_decode.policy import AdaptivePolicy, FixedPolicy, allocate, draft_widths, survival
from adaspec.spec_decode.synthetic import SyntheticDrafter, load_synthetic_drafter

log = logging.getLogger("adaspec.spec")


class DrafterSetup:
    """Loaded before the KV cache is sized (the drafter's cache shares its blocks)."""

    def __init__(self, spec_cfg: SpeculativeConfig, drafter, drafter_cfg, drafter_path: str):
        self.spec_cfg, self.drafter, self.drafter_cfg, self.drafter_path = spec_cfg, drafter, drafter_cfg, drafter_path
        self.kv_caches = None  # allocate_kv_caches: before the target's graphs are captured, which write them

    def kv_block_bytes(self, block_size: int) -> int:
        n_layers, n_kv, hd = self.drafter.kv_cache_spec()
        return bytes_per_block(n_layers, n_kv, hd, block_size, next(self.drafter.parameters()).dtype)

    def allocate_kv_caches(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> list:
        """The drafter's context caches (same slots as the target's: they share block tables)."""
        if self.kv_caches is None:
            n_layers, n_kv, hd = self.drafter.kv_cache_spec()
            self.kv_caches = allocate_kv_caches(n_layers, num_slots, n_kv, hd, dtype, device)
        return self.kv_caches

    def write_context(self, captured: dict[int, torch.Tensor], positions: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
        """The drafter's context K/V from a target forward's captured layers, for its rows at these
        positions and cache slots. Device work only, so the target's CUDA graphs can capture it
        (engine/cuda_graphs.py: a plain step's context then costs no launches of its own)."""
        feats = torch.cat([captured[layer] for layer in self.drafter_cfg.target_layer_ids], dim=-1)
        self.drafter.write_context(feats, positions, slot_mapping, self.kv_caches)

    def build(self, engine, num_slots: int) -> "SpeculativeDecoder":
        return SpeculativeDecoder(engine, self, num_slots)


def load_speculative_drafter(config: EngineConfig, engine) -> DrafterSetup:
    from adaspec.models.drafter import load_drafter

    spec_cfg = SpeculativeConfig.from_dict(dict(config.speculative_config))
    if spec_cfg.method == "synthetic":  # timing only: a dummy-weight DSpark drafter, acceptance from a curve
        drafter, dcfg, name = load_synthetic_drafter(spec_cfg, engine)
    else:
        name = spec_cfg.model or DEFAULT_DRAFTERS.get(str(config.model))
        if name is None:
            raise ConfigError(
                "speculative_config needs \"model\": the drafter directory (only embedded targets have a default drafter)"
            )
        drafter, dcfg = load_drafter(name, engine.model_config, engine.dtype, engine.device)
    k = spec_cfg.num_speculative_tokens or dcfg.block_size
    if k > dcfg.block_size:
        raise ConfigError(
            f"num_speculative_tokens={k} exceeds the drafter's block_size={dcfg.block_size}; "
            f"use at most {dcfg.block_size}"
        )
    spec_cfg.num_speculative_tokens = k
    # the draft block may run past the target's last position: give the drafter's RoPE room
    drafter.rope.max_positions = max(drafter.rope.max_positions, engine.model_config.max_position_embeddings + dcfg.block_size)
    drafter.rope.build_tables(device=engine.device)
    drafter.attention_backend = "triton" if engine.attention_backend == "triton" else "reference"
    for layer in drafter.layers:  # fused qkv / gate_up projections, as the target's
        layer.self_attn.fuse()
        layer.mlp.fuse()
    return DrafterSetup(spec_cfg, drafter, dcfg, str(name))


class SpeculativeDecoder:
    def __init__(self, engine, setup: DrafterSetup, num_slots: int):
        # a weak reference: the engine holds this decoder (engine.spec), and a strong one back would
        # make a cycle that only the cyclic collector frees, so `del llm` kept the engine's and the
        # drafter's KV caches (~1 GiB each on a CPU) until a full collection, and a test worker
        # that ran engines back to back grew to 23.5 GB and was killed out of memory
        self.engine = weakref.proxy(engine)
        self.cfg = setup.spec_cfg
        self.drafter = setup.drafter
        self.dcfg = setup.drafter_cfg
        self.num_spec_tokens = self.cfg.num_speculative_tokens
        self.block = self.dcfg.block_size  # positions the draft block occupies in the cache
        self.capture_layers = list(self.dcfg.target_layer_ids)
        self.setup = setup
        self.kv_caches = setup.allocate_kv_caches(num_slots, engine.dtype, engine.device)
        self.num_context_rows_written_eagerly = 0  # write_context's rows that no graph had written
        self.greedy_drafts = self.cfg.draft_sample_method == "greedy"
        # the widths an adaptive step may draft (adaptive_draft_width "budget": also ~k/4 and ~k/2)
        self.draft_widths = draft_widths(self.num_spec_tokens, bool(self.cfg.enable_adaptive_verification)
                                         and self.cfg.adaptive_draft_width == "budget")
        self.graphed = None  # graphed_step.GraphedSpecStep: the decode path in CUDA graphs
        # the graphed launch's rows with top-k / top-p or logprobs, kept while the requests stay the
        # same (rebuilt every launch, 7 uploads with a filtered row: a helper's audit)
        self._row_extras = SameRequestsCache(RowExtras.of)
        self._eager_sampling = SamplingBatchCache()  # the eager step's drafted rows, likewise
        self._decided: bool | None = None  # decide_drafting's answer for the step about to run
        if engine.use_cuda_graphs and getattr(engine, "tp", None) is None:  # TP: the mirrored eager step
            from adaspec.spec_decode.graphed_step import GraphedSpecStep

            self.graphed = GraphedSpecStep(self, engine)
            self.graphed.capture()
            self._verify_apart()
        if self.cfg.enable_adaptive_verification:
            from adaspec.spec_decode.profiler import build_cost_model

            self.cost_model = build_cost_model(engine, self, setup.drafter_path)
        else:
            self.cost_model = None
        self.policy = self._make_policy()
        if engine.device.type == "cuda" and getattr(engine, "tp", None) is None:  # TP: the drafter is mirrored
            self._warm_up_context()
        engine.stats.ensure_positions(self.num_spec_tokens)
        engine.stats.synthetic_acceptance = getattr(self.drafter, "label", None)  # "synthetic acceptance: timing only"

    def _make_policy(self):
        if self.cost_model is None:
            return FixedPolicy()
        step_cost = self.cost_model
        if self.graphed is not None:  # the policy prices the padded graph a step really runs
            from adaspec.spec_decode.graphed_step import GraphPaddedCost

            step_cost = GraphPaddedCost(self.cost_model, self.graphed)
        from adaspec.spec_decode.online_calibration import SurvivalCorrection
        from adaspec.spec_decode.step_costs import MeasuredStepCosts
        from adaspec.spec_decode.step_overhead import StepOverhead

        return AdaptivePolicy(step_cost, self.num_spec_tokens, self.cfg.adaptive_verification_ema_alpha,
                              overhead=StepOverhead(self.cfg.adaptive_verification_step_overhead_ms),
                              step_costs=MeasuredStepCosts() if self.measures_step_costs() else None,
                              correction=SurvivalCorrection(self.num_spec_tokens)
                              if self.cfg.adaptive_verification_online_calibration else None,
                              unobserved=self.cfg.adaptive_verification_unobserved_confidence,
                              mixed_steps=self.cfg.adaptive_verification_mixed_steps,
                              # engine.stats is replaced after the warm-up: look it up at each call,
                              # through the engine's weak proxy (a closure over self would tie this
                              # decoder in a cycle with its policy: __init__ says why none may)
                              on_step_cost=lambda *a, engine=self.engine: engine.stats.record_step_cost(*a))

    def forget_history(self) -> None:
        """A fresh policy (nothing learned: confidences, online calibration, measured costs) and
        zeroed counters, as after startup (engine/warm_up.py calls it after its dummy requests)."""
        self.policy = self._make_policy()
        self.num_context_rows_written_eagerly = 0

    def measures_step_costs(self) -> bool:
        """adaptive_verification_step_costs "measured" (opt-in; config.py says why)."""
        return self.cfg.adaptive_verification_step_costs == "measured"

    def _warm_up_context(self) -> None:
        """Write the drafter's context for 1 and for 2 rows into the scratch block once, so that
        the compiled pointwise kernels it uses exist for both (dynamic shapes specialize a size of
        1) before a request needs them: a plain step of one request under async scheduling writes
        one row eagerly, and compiling then stalled the first such steps on the H200."""
        eng = self.engine
        width = self.drafter.fc.in_features
        scratch = eng.scratch_block * eng.config.block_size
        for n in (1, 2):
            self.drafter.write_context(
                torch.ones(n, width, dtype=eng.dtype, device=eng.device),
                torch.zeros(n, dtype=torch.int64, device=eng.device),
                torch.full((n,), scratch, dtype=torch.int64, device=eng.device), self.kv_caches)

    def use_graphs(self, graphed) -> None:
        """Run decode steps through `graphed` (a captured GraphedSpecStep; CPU tests pass one
        captured with eager=True) and price them as it runs them."""
        self.graphed = graphed
        self.policy = self._make_policy()
        self._verify_apart()

    def _verify_apart(self) -> None:
        """The graphs verify the decoding rows in a forward of their own: tell the scheduler, so
        that their draft slots leave the token budget to the prefill chunks (scheduler.py)."""
        g = self.graphed
        self.engine.scheduler.set_verify_apart(g.batch_sizes[-1] if g is not None else 0)

    # -- pieces also used by the profiler ------------------------------------------------------
    def propose(self, seqs, anchor_ids, anchor_pos, block_tables, sampling: SamplingBatch | None = None,
                width: int | None = None):
        """sampling: the requests' SamplingBatch (built here when not given); greedy drafting
        overrides every row's temperature with 0. width: the slots to draft (default k)."""
        dev = self.engine.device
        if sampling is None:
            sampling = SamplingBatch.build([s.params for s in seqs], [s.seed for s in seqs], dev)
        if self.greedy_drafts and not sampling.all_greedy:
            sampling = sampling.as_greedy()
        return self.drafter.propose(
            to_device(anchor_ids, dev, torch.int64), to_device(anchor_pos, dev, torch.int64), block_tables,
            self.engine.config.block_size, self.kv_caches, sampling, anchor_pos_host=list(anchor_pos),
            # heads for the k slots verified at most (k < block_size: fixed k), or fewer (a narrow draft)
            width=self.num_spec_tokens if width is None else width,
            # requests' logits rules, as far as the drafter can follow them (logits_rules.draft_bias);
            # not under tensor parallelism, whose mirrored drafter takes the same arguments on every rank
            draft_bias=None if getattr(self.engine, "tp", None) is not None
            else draft_bias(seqs, self.engine.model_config.vocab_size, dev),
        )

    def forget(self, seq) -> None:
        self.policy.forget(seq.request_id)

    # -- the step ------------------------------------------------------------------------------
    def step(self, scheduled: list[ScheduledSeq], on_ready) -> None:
        """Run one step; on_ready(indices, results) receives the new tokens of the rows `indices`
        (results[j] = (tokens, logprobs) of scheduled[indices[j]]) as soon as they are on the host:
        in a mixed step the graphed rows first, while the GPU still runs the other rows' forward,
        so the engine's stop checks and outputs for them overlap it. Every row is reported once."""
        t0 = time.perf_counter()
        callback_s = 0.0
        emitted = 0
        counting = getattr(self.policy, "step_costs", None) is not None  # only the measured policy reads it

        def report(indices, results):
            nonlocal callback_s, emitted
            c0 = time.perf_counter()
            if counting:
                emitted += sum(len(tokens) for tokens, _ in results)
            on_ready(indices, results)
            callback_s += time.perf_counter() - c0

        try:
            self._run(scheduled, report)
        finally:
            self._decided = None  # decide_drafting's answer holds for one step
        if counting:
            self.policy.step_tokens(emitted)  # the measured step costs' yield of this step
        # the adaptive policy learns what a step costs beyond its tables (when it measures that:
        # step_overhead.py); the wall time covers both parts of a mixed step and the read backs,
        # not the engine's work on the tokens
        self.policy.observe_step(1e3 * (time.perf_counter() - t0 - callback_s))

    def _run(self, scheduled: list[ScheduledSeq], report) -> None:
        g = self.graphed
        every = list(range(len(scheduled)))
        if g is not None and self._decided is None:
            self.decide_mixed(scheduled)
        if g is None or self._decided is False and self.fuses_mixed_steps():
            # no graphs, or a step with prompt chunks that does not draft (mixed_steps "fused"): one
            # forward for every row (the runner's mixed graph where one holds it), as no-spec runs it
            parts = [(every, False)]
        else:
            covered = [i for i, s in enumerate(scheduled) if self._row_covered(s)][: g.batch_sizes[-1]]
            if len(covered) in (0, len(scheduled)):
                parts = [(every, bool(covered))]
            else:
                # a mixed step (a prefill chunk, or more decoding rows than the graphs hold): the
                # decoding rows take the graphs, the rest the eager step; two forwards, but the eager one is paid
                # anyway and with continuous arrivals most steps at high concurrency are mixed. Both
                # are launched before either is read back: the graphs' results come back while the
                # GPU runs the eager forward, and the host works on them meanwhile
                chosen = set(covered)
                parts = [(covered, True), ([i for i in every if i not in chosen], False)]
        # a step split in two forwards is not one to measure as its parts' shapes (step costs,
        # overhead, cost check): its wall holds the other part's forward too
        launched = [(idx, self._launch(scheduled if len(idx) == len(scheduled) else [scheduled[i] for i in idx],
                                       graphed, whole=len(parts) == 1)) for idx, graphed in parts]
        for idx, finish in launched:
            report(idx, finish())

    def fuses_mixed_steps(self) -> bool:
        """adaptive_verification_mixed_steps "fused" (config.py says why)."""
        return self.cfg.enable_adaptive_verification and self.cfg.adaptive_verification_mixed_steps == "fused"

    def _prefill_tokens(self, scheduled: list[ScheduledSeq]) -> int:
        """The step's query tokens outside its decoding rows (prompt chunks, recomputation): what
        the fused policy prices at the margin; 0 (decode tables alone) unless the mode is fused."""
        if not self.fuses_mixed_steps():
            return 0
        return sum(s.num_tokens for s in scheduled if not self._row_covered(s))

    def _sampling_rows(self, scheduled: list[ScheduledSeq], samples, prefill_tokens: int) -> int:
        """n_sampling for the policy: the rows that sample; where the fused policy prices prompt
        chunks at the margin, the decoding rows only (a chunk that ends its prompt samples in
        either kind of step, and its token is no yield of drafting)."""
        if prefill_tokens:
            return sum(1 for s in scheduled if self._row_covered(s))
        return int(sum(samples))

    def decide_mixed(self, scheduled: list[ScheduledSeq]) -> bool | None:
        """Under mixed_steps "fused", with graphs: a step with decoding rows the graphs serve and
        prompt chunks asks the policy once whether those rows draft, pricing the chunks' forward in
        (policy.mixed_step_drafts; drafting would run the rows graphed beside the chunks' forward).
        The answer holds for this step (self._decided); a False one runs it as one forward. None:
        not such a step, or another mode."""
        g = self.graphed
        if g is None or not self.fuses_mixed_steps():
            return None
        prefill = self._prefill_tokens(scheduled)
        if not prefill:  # a decode-only step (rows past the largest graph included): asked as before
            return None
        covered = [s for s in scheduled if self._row_covered(s)][: g.batch_sizes[-1]]
        drafted = [s for s in covered if s.spec_slots > 0]
        if not drafted:
            return None
        self._decided = self._ask_mixed([s.seq.request_id for s in drafted], len(covered),
                                        [s.spec_slots for s in drafted], prefill)
        return self._decided

    def _ask_mixed(self, request_ids, num_covered: int, limits, prefill: int) -> bool:
        """The policy's margin question for a step with prompt chunks (decide_mixed), counted."""
        decided = self.policy.should_draft(request_ids, num_covered, num_covered, np.array(limits, dtype=np.int64),
                                           prefill_tokens=prefill, prefill_apart=True)
        if decided is False:
            self.engine.stats.num_steps_draft_skipped += 1
            self.engine.stats.num_mixed_steps_fused += 1
        return decided

    def mixed_step_stays_plain(self, scheduled: list[ScheduledSeq]) -> bool:
        """Under mixed_steps "fused", with graphs: a step scheduled without draft slots while a plain
        step is in flight (its rows' last tokens still on the device, behind placeholders) is one
        the engine may launch as the async plain step, behind the one in flight, when it carries
        prompt chunks and the policy would not draft its decoding rows beside them: decide_mixed's
        question, each row's slots counted as the scheduler would reserve them (k, at most the
        tokens it may still emit - 1). Chunk steps the policy runs plain then overlap their host
        work with the GPU as no-spec's do (run synchronously, each cost the 8B shape ~5-8 ms more
        than no-spec's: H200 run 43, --step-trace). True also when no row could draft."""
        g = self.graphed
        if g is None or not self.fuses_mixed_steps():
            return False
        prefill = self._prefill_tokens(scheduled)
        if not prefill:  # a decode-only step: the decode tables decide it, knowing every token
            return False
        covered = [s for s in scheduled if self._row_covered(s)][: g.batch_sizes[-1]]
        need = self.engine.scheduler._running_need  # the slots a schedule with drafts would reserve (apart)
        ids, limits = [], []
        for s in covered:
            slots = (need(s.seq, True, self.num_spec_tokens + 1, True) or (0, 0))[1]
            if slots:  # a decoding row with a slot to draft
                ids.append(s.seq.request_id)
                limits.append(slots)
        return not ids or self._ask_mixed(ids, len(covered), limits, prefill) is False

    def drop_mixed_decision(self) -> None:
        """decide_mixed's answer is spent: the engine runs the step it judged as its own async
        plain step (not through step() or launch_pipelined, which would take the answer)."""
        self._decided = None

    # -- pipelined steps (pipelined.py) --------------------------------------------------------
    def can_pipeline(self, scheduled: list[ScheduledSeq]) -> bool:
        g = self.graphed
        return g is not None and pipelinable(scheduled, self._row_pipelined, g.batch_sizes[-1])

    def launch_pipelined(self, scheduled: list[ScheduledSeq], prev: InFlightSpecStep | None,
                         serial: int, on_read_back: Callable[[], None] | None = None) -> InFlightSpecStep:
        """Launch the step without reading anything back (can_pipeline(scheduled) holds): the
        covered rows as the graphed step, taking from `prev` (still in flight) on the device the
        last token and position of the requests its graphs ran, and the first token of those whose
        prefill it finished (a PENDING placeholder on the host); the prefill chunks eagerly, their
        sampled tokens left on the device behind such placeholders. The graphed rows are marked in
        flight (Sequence.in_flight_max). on_read_back: called by its finish() right after the
        graphed rows' read back (the measured step costs' clock, LLMEngine._time_spec_step)."""
        t0 = time.perf_counter()
        graphed = [i for i, s in enumerate(scheduled) if self._row_pipelined(s)]
        graphed_set = set(graphed)
        prefill = [i for i in range(len(scheduled)) if i not in graphed_set]
        finish = None
        timing = getattr(self.policy, "step_costs", None) is not None  # only the measured policy times steps
        if timing:
            self.policy.planned_step_kind()  # a plan from before this launch (a synchronous step's) is not this one's
        if graphed:
            rows = [scheduled[i] for i in graphed]
            carried = first_tokens = None
            if prev is not None:
                carried, first_tokens = carried_rows(rows, prev)
            drafted = [r for r, s in enumerate(rows) if s.spec_slots > 0]
            decided, self._decided = self._decided, None  # decide_mixed's answer, for this step only
            if drafted and decided is None:
                decided = self.policy.should_draft(
                    [rows[r].seq.request_id for r in drafted], len(rows), len(rows),
                    np.array([rows[r].spec_slots for r in drafted], dtype=np.int64))
                self.engine.stats.num_steps_draft_skipped += not decided
            if decided is False:
                drafted = []
            finish = self._launch_graphed(rows, drafted, [True] * len(rows), t0, carried=carried, serial=serial,
                                          first_tokens=first_tokens, on_read_back=on_read_back)
            drafting = bool(drafted)
            for s in rows:
                s.seq.in_flight_max = 1 + (s.spec_slots if drafting else 0)
                s.seq.in_flight_step = serial
        self._decided = None
        # a step whose chunks run beside its graphed rows is not a decode-only step's cost
        cost_kind = self.policy.planned_step_kind() if timing and graphed and not prefill else None
        pending, sampling_rows = None, []
        if prefill:
            pending, sampling_rows = self._launch_prefill([scheduled[i] for i in prefill])
            sampling_rows = [prefill[j] for j in sampling_rows]
        return InFlightSpecStep(serial, scheduled, graphed, finish, pending, sampling_rows, t0,
                                cost_kind=cost_kind, behind=prev is not None)

    def _launch_prefill(self, rows: list[ScheduledSeq]):
        """Prefill chunks (and recomputation after preemption) as one forward; their K/V and the
        drafter's context are final at once, the tokens the finished prompts sample stay on the
        device behind a PENDING placeholder each (engine/async_step.py). -> (InFlightStep of those
        tokens or None, indices into rows of the sampling ones)."""
        eng = self.engine
        t0 = time.perf_counter()
        items = [ForwardItem(s.seq.token_ids[s.seq.num_computed_tokens:s.seq.num_computed_tokens + s.num_tokens],
                             s.seq.num_computed_tokens, s.seq.block_table,
                             logits_rows(s.seq, s.seq.num_computed_tokens, s.num_tokens, s.samples)) for s in rows]
        res = eng.runner.execute(items, self.capture_layers)
        self.write_context(rows, [s.num_tokens for s in rows], res)
        sampling = [j for j, s in enumerate(rows) if s.samples]
        logits = self._sampling_logits(res.logits, rows, items, sampling)
        for s in rows:
            s.seq.num_computed_tokens += s.num_tokens
        eng.stats.time_verify += time.perf_counter() - t0
        if not sampling:
            return None, []
        seqs = [rows[j].seq for j in sampling]
        shown, logits = logits_with_rules(logits, rows_of(seqs))  # (logprobs show the grammars' masks only)
        chosen = eng._sample_on_device(logits, seqs, ruled=True)
        want = [q.params.logprobs for q in seqs]
        lp = logprobs_of(shown, chosen, max(w or 0 for w in want)) if any(w is not None for w in want) else ()
        return InFlightStep.launch(seqs, chosen, lp, want), sampling  # counted as read back (_finish_spec)

    @staticmethod
    def _sampling_logits(logits: torch.Tensor, rows: list[ScheduledSeq], items: list[ForwardItem],
                         sampling: list[int]) -> torch.Tensor:
        """The logits of the sampling rows (indices into rows), one each, from a forward of rows'
        items, after the items that asked for more rows than their sampling one (prompt logprobs;
        a 1-token chunk mid-prompt: one row and no sampling row) recorded theirs."""
        recording = [(s.seq, s.seq.num_computed_tokens, s.num_tokens, i) for i, s in enumerate(rows)
                     if items[i].num_logits > int(s.samples)]
        return sampling_logits(logits, items, recording, sampling) if recording else logits

    def _launch(self, scheduled: list[ScheduledSeq], graphed: bool, whole: bool = True):
        """Queue the step's GPU work for these rows. -> finish(): reads the results back and
        returns them. graphed: every row is one the graphs serve (_run decided). whole=False: the
        rows are one part of a step split in two forwards, which the policy does not measure."""
        stats = self.engine.stats
        t0 = time.perf_counter()
        # every row the graphs serve samples (_row_covered): not asked again for each
        samples = [True] * len(scheduled) if graphed else [s.samples for s in scheduled]
        drafted = [i for i, s in enumerate(scheduled) if s.spec_slots > 0]
        decided = self._decided  # decide_drafting's or decide_mixed's answer for this step, if asked
        if drafted and decided is None:
            prefill = self._prefill_tokens(scheduled)
            decided = self.policy.should_draft(
                [scheduled[i].seq.request_id for i in drafted], self._sampling_rows(scheduled, samples, prefill),
                sum(s.num_tokens for s in scheduled), np.array([scheduled[i].spec_slots for i in drafted], dtype=np.int64),
                prefill_tokens=prefill)
            stats.num_steps_draft_skipped += not decided
        if decided is False:
            drafted = []
        if graphed:
            return self._launch_graphed(scheduled, drafted, samples, t0, whole=whole)
        return self._launch_eager(scheduled, drafted, samples, t0, whole=whole)

    def _launch_eager(self, scheduled, drafted, samples, t0, whole: bool = True):
        eng, stats, k = self.engine, self.engine.stats, self.num_spec_tokens
        drafted_seqs = [scheduled[i].seq for i in drafted]
        num_verify = np.zeros(len(scheduled), dtype=np.int64)
        num_planned = num_verify  # the policy's lengths, before structured outputs' cap (calibration reads these)
        proposal = conf = sampling = None
        draft_host: list[list[int]] = []
        if drafted:
            sampling = self._eager_sampling.get(drafted_seqs, eng.device)
            ids = [s.request_id for s in drafted_seqs]
            limits = np.array([scheduled[i].spec_slots for i in drafted], dtype=np.int64)
            base_tokens = sum(s.num_tokens for s in scheduled)
            budget = width = None
            if len(self.draft_widths) > 1 and self.cost_model is not None:
                # a narrow draft: the budget and the width from the old confidences, before drafting
                budget = self.policy.step_budget(ids, int(sum(samples)), base_tokens, limits, whole=whole)
                width = self.policy.draft_width(ids, budget, limits, self.draft_widths)
                limits = np.minimum(limits, width)
            proposal = self.propose(drafted_seqs, [s.token_ids[-1] for s in drafted_seqs],
                                    [len(s.token_ids) - 1 for s in drafted_seqs],
                                    [s.block_table for s in drafted_seqs], sampling, width=width)
            conf = proposal.confidences[:, :k].float().cpu().numpy()
            if width is None:
                verify_lens = self.policy.plan(ids, conf, int(sum(samples)), base_tokens, limits, whole=whole)
            else:  # allocated by this step's confidences as plan does; slots past the width are NaN
                verify_lens = allocate(survival(conf), budget, limits)
                conf = np.concatenate([conf, np.full((len(ids), k - conf.shape[1]), np.nan)], axis=1)
            self.policy.observe(ids, conf)
            draft_host = proposal.tokens[:, :k].tolist()
            # structured outputs: nothing after a draft the grammar refuses can be accepted, so the
            # positions past it are not verified (structured_outputs.grammar_reach)
            num_planned = num_verify.copy()
            num_planned[drafted] = verify_lens
            verify_lens = np.minimum(verify_lens, grammar_reach(drafted_seqs, draft_host))
            num_verify[drafted] = verify_lens
        t1 = time.perf_counter()

        items, drafted_set = [], set(drafted)
        draft_row = {i: n for n, i in enumerate(drafted)}
        for i, s in enumerate(scheduled):
            seq, nc = s.seq, s.seq.num_computed_tokens
            if i in drafted_set:
                n_verify = int(num_verify[i])
                items.append(ForwardItem([seq.token_ids[-1]] + draft_host[draft_row[i]][:n_verify], nc, seq.block_table,
                                         n_verify + 1))
            else:
                items.append(ForwardItem(seq.token_ids[nc:nc + s.num_tokens], nc, seq.block_table,
                                         logits_rows(seq, nc, s.num_tokens, samples[i])))
        res = eng.runner.execute(items, self.capture_layers)
        stats.time_draft += t1 - t0
        stats.time_verify += time.perf_counter() - t1

        def finish():
            t2 = time.perf_counter()
            # rows of res.logits: n_verify + 1 per drafted request, 1 per other sampling request, in item order
            row_start = np.cumsum([0] + [it.num_logits for it in items])
            results: list = [([], None)] * len(scheduled)
            accepted = np.zeros(len(scheduled), dtype=np.int64)
            if drafted:
                results, accepted = self._accept(scheduled, drafted, drafted_seqs, sampling, num_verify, proposal, conf,
                                                 res.logits, row_start, results, num_planned)
            plain = [i for i in range(len(scheduled)) if samples[i] and i not in drafted_set]
            prompt = [i for i in range(len(scheduled)) if i not in drafted_set and items[i].num_logits > int(samples[i])]
            if prompt:  # chunks that record prompt logprobs (engine/prompt_logprobs.py)
                record_prompt_logprobs(res.logits, [(scheduled[i].seq, scheduled[i].seq.num_computed_tokens,
                                                     scheduled[i].num_tokens, int(row_start[i])) for i in prompt])
            if plain:  # each one's sampling row: its last
                rows = to_device(row_start[np.asarray(plain) + 1] - 1, res.logits.device)
                toks, lps = eng.sample(res.logits[rows], [scheduled[i].seq for i in plain])
                for n, i in enumerate(plain):
                    results[i] = ([toks[n]], [lps[n]] if lps is not None else None)
                eng.stats.num_sampled_without_draft += len(plain)
            t3 = time.perf_counter()
            self._commit(scheduled, drafted_set, accepted, res, items)
            stats.time_sample += t3 - t2
            stats.time_bookkeeping += time.perf_counter() - t3
            return results

        return finish

    # -- the graphed decode path (graphed_step.py) ----------------------------------------------
    @staticmethod
    def _row_covered(s: ScheduledSeq) -> bool:
        """Decodes one token. Its sampling parameters do not matter: the graphs sample with the
        temperature alone, and a row with top-k / top-p, a logits rule or logprobs has its part of
        the step redone right after the replay (graphed_extras.py; until then such a row sent its
        whole step to the eager speculative step, and ruled rows ran in it until the redo took rules)."""
        return s.num_tokens == 1 and s.samples

    @classmethod
    def _row_pipelined(cls, s: ScheduledSeq) -> bool:
        """A row the graphs serve in a pipelined step: not one with a logits rule, which reads the
        request's whole history on the host, the tokens of the step still in flight included."""
        return cls._row_covered(s) and s.seq.logits_rule is None

    def _launch_graphed(self, scheduled, drafted, samples, t0, carried=None, serial: int | None = None,
                        first_tokens=None, whole: bool = True, on_read_back: Callable[[], None] | None = None):
        """The step as two graph replays and one read back (graphed_step.py). -> finish().
        Pipelined (serial given): carried rows take their inputs from the previous launch's carry
        (GraphedSpecStep.launch), and finish() skips the rows of requests that ended meanwhile and
        keeps the blocks of those that a later step in flight runs."""
        eng, stats, k, g = self.engine, self.engine.stats, self.num_spec_tokens, self.graphed
        seqs = [s.seq for s in scheduled]
        drafting = bool(drafted)
        slots = np.array([s.spec_slots if drafting else 0 for s in scheduled], dtype=np.int64)
        budget = width = None
        max_tokens = len(scheduled) + int(slots.sum())
        if drafting and self.cost_model is not None:
            ids = [q.request_id for q in seqs]
            budget = self.policy.step_budget(ids, int(sum(samples)), sum(s.num_tokens for s in scheduled), slots,
                                             whole=whole)
            if len(g.widths) > 1:  # adaptive_draft_width "budget": draft the slots the budget can use
                width = self.policy.draft_width(ids, budget, slots, g.widths)
                slots = np.minimum(slots, width)
            max_tokens = min(len(scheduled) + int(slots.sum()), len(scheduled) + budget)
        key = g.pick(len(scheduled), max_tokens, drafting)
        extras = self._row_extras.get(seqs, eng.device)  # rows with top-k / top-p, rules or logprobs (graphed_extras.py)
        g.launch(key, [q.token_ids[-1] for q in seqs], [len(q.token_ids) - 1 for q in seqs], slots,
                 [q.seed for q in seqs], [0.0 if q.params.greedy else float(q.params.temperature) for q in seqs],
                 [q.block_table for q in seqs], drafting, budget, carried, first_tokens, draft_width=width,
                 extras=extras)
        launch_s = time.perf_counter() - t0

        def finish():
            t_wait = time.perf_counter()
            rb, logprobs = g.read_back()
            t1 = time.perf_counter()
            if on_read_back is not None:
                on_read_back()
            n = len(scheduled)
            tokens, n_acc, nq = rb[:n, : k + 1], rb[:n, k + 1], rb[:n, k + 2]
            # rows with draft slots drafted (when the step drafts); the others only sampled their next
            # token, as in the eager step (their drafts, made in the same graph, are never verified).
            # Python lists from here: per-row numpy indexing was a third of this loop's time at 256
            if drafting and carried is not None:  # the slots the device gave carried rows (their cap)
                self._capped_slots(seqs, carried[0], slots)
            rows = np.flatnonzero(slots) if drafting else np.zeros(0, dtype=np.int64)
            accepted = np.where(slots > 0, n_acc, 0).tolist() if len(rows) else [0] * n
            token_rows = tokens.tolist()
            results = [(row[: a + 1], None) for row, a in zip(token_rows, accepted)]
            # pipelined: requests that ended (or were aborted) after this step was launched
            gone = [r for r, seq in enumerate(seqs) if seq.finished] if serial is not None else []
            if gone:
                for r in gone:
                    results[r] = ([], None)
                stats.num_discarded_rows += len(gone)
                rows = np.setdiff1d(rows, gone)
            if logprobs is not None:
                add_logprobs(results, extras, logprobs)
            if len(rows):
                conf = rb[rows, k + 3:].astype(np.int32).view(np.float32)
                self.policy.observe([seqs[i].request_id for i in rows], conf)
                self._count(slots[rows], nq[rows] - 1, n_acc[rows], conf, width)
            stats.num_sampled_without_draft += n - len(gone) - len(rows)
            shrink = eng.block_manager.shrink
            if serial is None:
                for seq, a, slot in zip(seqs, accepted, slots.tolist()):  # the drafter's context: inside the graph
                    seq.num_computed_tokens += 1 + a
                    if drafting and slot:
                        shrink(seq, seq.num_computed_tokens + 1)
            else:
                for seq, a in zip(seqs, accepted):
                    if seq.finished:
                        continue
                    seq.num_computed_tokens += 1 + a
                    if seq.in_flight_step == serial:  # no later step in flight runs it
                        seq.in_flight_max = seq.in_flight_step = 0
                        shrink(seq, seq.num_computed_tokens + 1)
            # the launch, the replays and the wait for the read back: the GPU runs them in one go
            stats.time_graphed += launch_s + (t1 - t_wait)
            stats.num_graphed_steps += 1
            stats.time_bookkeeping += time.perf_counter() - t1
            return results

        return finish

    def _capped_slots(self, seqs, rows, slots: np.ndarray) -> None:
        """slots[r] as the device capped it for the carried rows r (GraphedSpecStep._take_carry):
        at the tokens left less one, which the host knows once the step before is read back (it
        was, before this step's read back); a carried row of a request that ended is left as is."""
        max_len = self.engine.max_model_len
        for r in rows:
            seq = seqs[r]
            if seq.finished:
                continue
            left = max_len - len(seq.token_ids)
            if seq.params.max_tokens is not None:
                left = min(left, seq.params.max_tokens - seq.num_output_tokens)
            slots[r] = max(0, min(int(slots[r]), left - 1))

    def _count(self, spec_slots, verify_lens, n_acc, conf, width: int | None = None, planned=None) -> None:
        """Statistics of the drafted requests: drafts proposed, verified, accepted (per position),
        calibration (predicted against realized acceptance). spec_slots: each drafted request's
        draft slots (a pipelined step's as capped on the device, a narrow draft's capped at its
        width). width: slots each request drafted (default k). planned: the policy's lengths
        where structured outputs capped verify_lens (grammar_reach): the slots it skipped were
        certain rejections, and calibration counts them so (left out, they would raise the shared
        realized / predicted factors); num_verified_tokens counts what was verified."""
        surv = survival(conf)
        counted = verify_lens if planned is None else planned
        stats = self.engine.stats
        stats.record_drafts(self.num_spec_tokens, spec_slots, counted, n_acc, surv, drafted=width)
        if planned is not None:
            skipped = int(np.sum(np.asarray(planned) - np.asarray(verify_lens)))
            stats.num_verified_tokens -= skipped
            stats.num_grammar_skipped_slots += skipped
        self.policy.observe_outcomes(counted, n_acc, surv)

    def _accept(self, scheduled, drafted, drafted_seqs, sampling, num_verify, proposal, conf, logits, row_start,
                results, num_planned=None):
        k = min(self.num_spec_tokens, proposal.tokens.shape[1])  # slots drafted (fewer: a narrow draft)
        dev = logits.device
        R = len(drafted)
        verify_lens = num_verify[drafted]
        # [R, k+1] row index of each verify position (positions past l_r repeat the last row)
        idx = row_start[drafted][:, None] + np.minimum(np.arange(k + 1)[None, :], verify_lens[:, None])
        idx_t = to_device(idx.reshape(-1), dev)
        ver_logits = logits[idx_t]  # [R*(k+1), V]
        # position j's distribution with the request's logits rule, as if drafts 0..j-1 were accepted
        ruled_logits = ver_logits
        if any(s.logits_rule is not None for s in drafted_seqs):
            drafts = proposal.tokens[:, :k].tolist()
            row_seqs = [s for s in drafted_seqs for _ in range(k + 1)]
            before = [drafts[n][:min(j, int(verify_lens[n]))] for n in range(R) for j in range(k + 1)]
            # (the logprobs show the grammars' masks only, as vLLM's)
            ver_logits, ruled_logits = logits_with_rules(ver_logits, rows_of(row_seqs, extras=before))
        p = sampling.probs(ruled_logits, repeat=k + 1).view(R, k + 1, -1)
        q = None if self.greedy_drafts else proposal.probs[:, :k].float()
        anchors = to_device([len(s.token_ids) - 1 for s in drafted_seqs], dev, torch.int64)
        # synthetic (timing only): acceptance drawn from the configured curve instead of p and q
        accept = self.drafter.accept if isinstance(self.drafter, SyntheticDrafter) else rejection_sample
        out = accept(
            proposal.tokens[:, :k], to_device(verify_lens, dev), p, q, to_device(sampling.greedy, dev),
            sampling.seeds, anchors, target_argmax=ruled_logits.argmax(-1).view(R, k + 1),
        )
        toks = out.output_tokens.tolist()
        n_acc = out.num_accepted.tolist()
        want_lp = sampling.logprobs
        lp_rows = None
        if sampling.want_logprobs():
            chosen = out.output_tokens.clamp_min(0).view(-1)
            top_n = max(w or 0 for w in want_lp)
            c_lp, top_ids, top_lp = logprobs_of(ver_logits, chosen, top_n)
            lp_rows = (c_lp.view(R, k + 1).tolist(), top_ids.view(R, k + 1, -1).tolist(), top_lp.view(R, k + 1, -1).tolist())
        accepted = np.zeros(len(scheduled), dtype=np.int64)
        results = list(results)
        for n, i in enumerate(drafted):
            n_accepted = n_acc[n]
            accepted[i] = n_accepted
            emitted = toks[n][: n_accepted + 1]
            lps = None
            if lp_rows is not None and want_lp[n] is not None:
                w = want_lp[n]
                lps = [{**dict(zip(lp_rows[1][n][j][:w], lp_rows[2][n][j][:w])), emitted[j]: lp_rows[0][n][j]}
                       for j in range(n_accepted + 1)]
            results[i] = (emitted, lps)
        spec_slots = [scheduled[i].spec_slots for i in drafted]
        if k < self.num_spec_tokens:  # a narrow draft: the slots it capped are the width's
            spec_slots = np.minimum(spec_slots, k)
        planned = None if num_planned is None else num_planned[drafted]
        if planned is not None and np.array_equal(planned, verify_lens):
            planned = None
        self._count(spec_slots, verify_lens, n_acc, conf, k, planned)
        return results, accepted

    def _commit(self, scheduled, drafted_set, accepted, res, items) -> None:
        """Move num_computed_tokens, give back rejected blocks, write the drafter's context."""
        eng = self.engine
        n_valid = [1 + int(accepted[i]) if i in drafted_set else s.num_tokens for i, s in enumerate(scheduled)]
        self.write_context(scheduled, n_valid, res)
        for i, s in enumerate(scheduled):
            s.seq.num_computed_tokens += n_valid[i]
            if i in drafted_set:
                eng.block_manager.shrink(s.seq, s.seq.num_computed_tokens + 1)

    def write_context(self, scheduled: list[ScheduledSeq], n_valid: list[int], res) -> None:
        """The drafter's context K/V for the first n_valid[i] query rows of each row of a forward
        `res` that captured the drafter's target layers, at positions from num_computed_tokens on
        (called before they move). Device work only: a plain step under async scheduling calls
        it for its rows too, whose input tokens may still be on the device. When every query row
        is kept (a plain step, a prefill chunk) and the forward ran in one of the target's graphs,
        that graph wrote them already (res.context_written); otherwise the forward's own device
        positions and slots are used (the drafter shares the target's block tables). When only some
        rows are kept, the host builds their slots with a few integer operations per row (at 256
        requests a numpy array per row cost milliseconds a step)."""
        eng = self.engine
        bs = eng.config.block_size
        qs = res.query_start
        total = int(qs[len(scheduled)])
        if sum(n_valid) == total:  # every query row
            if res.context_written:  # inside the forward's graph
                return
            self.num_context_rows_written_eagerly += total
            if res.slot_mapping is not None:  # at the forward's own positions and slots
                self.setup.write_context({layer: res.captured[layer][:total] for layer in self.capture_layers},
                                         res.positions[:total], res.slot_mapping[:total])
                return
        self.num_context_rows_written_eagerly += sum(n_valid)
        positions, slots, rows = [], [], []
        for i, (s, n) in enumerate(zip(scheduled, n_valid)):
            nc, bt = s.seq.num_computed_tokens, s.seq.block_table
            start = int(qs[i])
            if n == 1:
                positions.append(nc)
                slots.append(bt[nc // bs] * bs + nc % bs)
                rows.append(start)
                continue
            pos = np.arange(nc, nc + n)
            positions.extend(pos.tolist())
            slots.extend((np.asarray(bt)[pos // bs] * bs + pos % bs).tolist())
            rows.extend(range(start, start + n))
        feats = torch.cat([res.captured[layer] for layer in self.capture_layers], dim=-1)
        feats = feats[to_device(np.asarray(rows, dtype=np.int64), eng.device)]
        self.drafter.write_context(
            feats, to_device(np.asarray(positions, dtype=np.int64), eng.device),
            to_device(np.asarray(slots, dtype=np.int64), eng.device), self.kv_caches,
        )

    def decide_drafting(self, scheduled: list[ScheduledSeq]) -> bool | None:
        """Ask the policy once for the whole step whether it drafts (adaptive under async
        scheduling without the speculative step's graphs, which runs a step that does not as an
        async plain step; with the graphs the steps are pipelined, launch_pipelined and
        decide_mixed ask); the step then keeps that decision. None: no row of the step could draft
        (all prefilling, or out of slots)."""
        self._decided = None
        drafted = [s for s in scheduled if s.spec_slots > 0]
        if not drafted:
            return None
        # without graphs one forward carries the chunks and the drafts (the fused mode's plain
        # choice as well), so they count in the tokens the drafts are verified with
        prefill = self._prefill_tokens(scheduled)
        self._decided = self.policy.should_draft(
            [s.seq.request_id for s in drafted], self._sampling_rows(scheduled, [s.samples for s in scheduled], prefill),
            sum(s.num_tokens for s in scheduled), np.array([s.spec_slots for s in drafted], dtype=np.int64),
            prefill_tokens=prefill)
        return self._decided

    def chunks_decided(self, scheduled: list[ScheduledSeq]) -> bool:
        """Whether decide_drafting's answer for this step was judged by its prompt chunks (the
        fused mode's margin): a skip then says nothing about the decode-only steps after it."""
        return self._prefill_tokens(scheduled) > 0
