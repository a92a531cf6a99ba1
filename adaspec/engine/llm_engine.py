"""LLMEngine: requests in, one batched step at a time, outputs out. Single-threaded by design:
the server calls it from one engine thread (see docs/ENGINE_API.md)."""
from __future__ import annotations

import logging
import os
import time
import weakref

import torch

from adaspec.announce import announce
from adaspec.config import EngineConfig, resolve_cudagraph_mode
from adaspec.distributed.context import join_tensor_parallel
from adaspec.engine.async_step import PENDING, InFlightStep, logprob_dicts, strip_pending
from adaspec.engine.block_manager import BlockManager
from adaspec.engine.kv_cache import allocate_kv_caches, bytes_per_block, num_kv_blocks
from adaspec.engine.parallel_sampling import ParallelSampling, ParentRequest, child_params, child_request_id
from adaspec.engine.prompt_logprobs import logits_rows, sampling_logits
from adaspec.engine.runner import ForwardItem, ModelRunner
from adaspec.engine.scheduler import DrainFirst, ScheduledSeq, Scheduler, check_whole_prompts_fit
from adaspec.engine.slow_steps import SlowStepLog, step_shape, threshold_from_env
from adaspec.engine.sequence import Sequence, SequenceStatus
from adaspec.engine.stats import EngineStats
from adaspec.engine.stop_checker import StopChecker
from adaspec.errors import ConfigError, InvalidRequestError
from adaspec.h2d import to_device
from adaspec.models.attention import triton_available, varlen_available
from adaspec.models.loader import load_target, model_dir, read_json, resolve_dtype
from adaspec.models.registry import model_display_name, resolve_model_path
from adaspec.models.generation_defaults import read_generation_defaults
from adaspec.models.tokenizer import Tokenizer, config_eos_token_ids
from adaspec.outputs import CompletionOutput, RequestOutput
from adaspec.sample.batch import SamplingBatch, SamplingBatchCache
from adaspec.sample.logits_rules import LogitsRule, apply_logits_rules, logits_with_rules, rows_of
from adaspec.sample.probs import logprobs_of
from adaspec.sample.random import SAMPLE, keyed_uniforms, new_seeds, sample_categorical
from adaspec.sampling_params import RequestOutputKind, SamplingParams, token_ids, truncated_prompt

log = logging.getLogger("adaspec.engine")
# the clock step() is timed with (EngineStats.time_in_steps); tests give a fake one
step_clock = time.perf_counter


def choose_attention_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """"auto": the Triton paged kernel on CUDA (no gather of the cache, CUDA-graph safe), else
    plain torch ("reference"). "varlen" (gather + flash) stays available on CUDA in half precision."""
    half = dtype in (torch.bfloat16, torch.float16)  # the flash kernel has no float32
    if name == "auto":
        if device.type == "cuda" and triton_available():
            return "triton"
        return "varlen" if varlen_available(device) and half else "reference"
    if name == "varlen" and not (varlen_available(device) and half):
        raise ConfigError("attention_backend 'varlen' needs CUDA, torch.nn.attention.varlen and dtype "
                          "bfloat16/float16; use 'reference'")
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("attention_backend 'triton' runs on CUDA (on the CPU only under TRITON_INTERPRET=1, for "
                          "tests); use 'reference'")
    if name == "triton" and not triton_available():
        raise ConfigError("attention_backend 'triton' needs the triton package (and CUDA, or TRITON_INTERPRET=1 "
                          "on CPU for tests); use 'reference'")
    return name


def resolve_device(name: str) -> torch.device:
    """"auto": $ADASPEC_DEVICE if set (the test suite pins it to cpu), else CUDA when present."""
    if name == "auto":
        name = os.environ.get("ADASPEC_DEVICE", "auto")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as e:  # "foo", "cuda:x": torch's own words, without its traceback
        raise ConfigError(f"device {name!r} is not a device torch knows ({e}); use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} was asked for but CUDA is not available; use --device cpu")
    return dev


def _has_grammar(seqs) -> bool:
    """Some unfinished request among these has structured outputs."""
    return any(s.logits_rule is not None and s.logits_rule.grammar is not None and not s.finished for s in seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        # ADASPEC_LOG_SLOW_STEPS_MS: a log line per slow step, with what compiled meanwhile (slow_steps.py)
        threshold = threshold_from_env()
        self._slow_steps = SlowStepLog(threshold, log, clock=lambda: step_clock()).install() if threshold is not None else None
        self._last_shape = "nothing scheduled"
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        # tensor parallelism (adaspec/distributed): None at size 1; rank 0 starts the workers here
        self.tp = tp = join_tensor_parallel(config, self.device)
        if tp is not None:
            self.device = tp.device
        path = model_dir(config.model)
        self.model_name = model_display_name(config.model)
        # the model's recommended sampling (vLLM's generation_config "auto"): defaults of requests
        # that leave them unset (LLM.get_default_sampling_params, the server's null fields)
        self.sampling_defaults, dropped = read_generation_defaults(path, config.generation_config)
        try:
            SamplingParams(**self.sampling_defaults)
        except (InvalidRequestError, TypeError) as e:
            raise ConfigError(f"the model's generation_config.json recommends sampling adaspec cannot use: {e} "
                              "(generation_config=\"vllm\" ignores it)") from None
        if self.sampling_defaults:
            announce(f"sampling defaults from the model's generation_config.json: {self.sampling_defaults} "
                     "(generation_config=\"vllm\" keeps SamplingParams' own)")
        if dropped:
            announce(f"WARNING: the model's generation_config.json recommends {dropped}, which adaspec does not "
                     "implement: requests sample without it")
        self.model, self.model_config = load_target(path, self.dtype, self.device, config.load_format,
                                                    shard=tp.shard_target if tp else None)
        self.model.fuse_projections()
        if config.skip_tokenizer_init:  # token ids only: outputs carry token_ids and empty text
            self.tokenizer = None
            eos_ids = config_eos_token_ids(path, read_json(path / "config.json", "config.json"))
        else:
            tok_path = resolve_model_path(config.tokenizer) if config.tokenizer else path
            self.tokenizer = Tokenizer.from_dir(tok_path, read_json(path / "config.json", "config.json"))
            eos_ids = self.tokenizer.eos_token_ids
        self._thinking_tags = self._thinking_tag_ids(config.reasoning_parser)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        if self.max_model_len > self.model_config.max_position_embeddings:
            raise ConfigError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings="
                f"{self.model_config.max_position_embeddings}"
            )
        self.attention_backend = backend = choose_attention_backend(config.attention_backend, self.device, self.dtype)

        self.spec = None  # speculative decoding (adaspec/spec_decode), built below when configured
        mc = self.model_config
        n_kv = tp.local_kv_heads(mc.num_key_value_heads) if tp else mc.num_key_value_heads  # this rank's KV heads
        block_bytes = bytes_per_block(mc.num_hidden_layers, n_kv, mc.head_dim, config.block_size, self.dtype)
        drafter = None
        if config.speculative_config is not None:  # {} too: the defaults
            from adaspec.spec_decode.step import load_speculative_drafter

            drafter = load_speculative_drafter(config, self)
            if tp:
                tp.shard_drafter(drafter.drafter)
            block_bytes += drafter.kv_block_bytes(config.block_size)
        check_whole_prompts_fit(config.max_num_batched_tokens, self.max_model_len, config.enable_chunked_prefill,
                                config.max_num_seqs, drafter.spec_cfg.num_speculative_tokens if drafter else 0,
                                drafter.spec_cfg.reserve_all_spec_slots if drafter else False)
        # a request's draft block may reach block_size positions past its last token
        lookahead = drafter.drafter_cfg.block_size if drafter else 0
        self.num_blocks = num_kv_blocks(config, block_bytes, self.max_model_len, self.device, lookahead)
        if tp:
            self.num_blocks = tp.agree_num_blocks(self.num_blocks)
        # one block past the allocator's: the scratch block where CUDA-graph padding writes its K/V
        self.scratch_block = self.num_blocks
        num_slots = (self.num_blocks + 1) * config.block_size
        self.kv_caches = allocate_kv_caches(
            mc.num_hidden_layers, num_slots, n_kv, mc.head_dim, self.dtype, self.device
        )
        self.block_manager = BlockManager(self.num_blocks, config.block_size)
        self.runner = ModelRunner(self.model, self.kv_caches, config.block_size, self.device, backend)
        self.stats = EngineStats()
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
            config.enable_chunked_prefill,
            num_spec_tokens=drafter.spec_cfg.num_speculative_tokens if drafter else 0,
            reserve_all_spec_slots=drafter.spec_cfg.reserve_all_spec_slots if drafter else False,
            draft_lookahead=drafter.drafter_cfg.block_size if drafter else 0,
        )
        # the plain decode step's sampling graphs (graphed_sampling.py), captured with the decode graphs
        self._decode_sampler = None
        self.use_cuda_graphs = (self.device.type == "cuda" and backend == "triton" and not config.enforce_eager
                                and config.cudagraph_mode != "NONE")
        if drafter is not None and tp is None:  # before the graphs, which write the drafter's context
            drafter.allocate_kv_caches(num_slots, self.dtype, self.device)
        if self.use_cuda_graphs:
            self._capture_graphs(drafter, lookahead)
        if self.device.type == "cuda" and backend == "triton" and tp is None:
            t0 = time.perf_counter()
            n = self.runner.warm_up(self.scratch_block, config.max_num_seqs, config.max_num_batched_tokens)
            torch.cuda.synchronize(self.device)
            announce(f"warmed up the eager forward's kernels ({n} prefill shapes) in {time.perf_counter() - t0:.1f} s")
        if tp:  # rank 0: proxies that announce each model call to the workers; a worker: registers them
            if tp.is_driver:  # weakly: the driver must not keep a dropped engine (its caches) alive
                tp.before_leave.append(weakref.WeakMethod(self.release_cuda_graphs))
            self.runner = tp.mirror("runner", self.runner)
            if drafter is not None:
                drafter.drafter = tp.mirror("drafter", drafter.drafter)
            if not tp.is_driver:  # the rest (policy, profiling, sampling) is rank 0's alone
                from adaspec.distributed.worker import allocate_drafter_caches

                allocate_drafter_caches(self, drafter, num_slots)
                return
        if drafter is not None:  # after the graphs: adaptive mode profiles dummy steps through them
            self.spec = drafter.build(self, num_slots)
        self.stop_checker = StopChecker(self.tokenizer, self.max_model_len, eos_ids)
        self.requests: dict[str, Sequence] = {}
        self.parallel = ParallelSampling()  # requests of n > 1 samples, run as n children
        self._aborted: list[Sequence] = []  # reported as finished by the next step()
        self._plain_sampling = SamplingBatchCache()  # the plain step's rows, while they stay the same
        self._unseeded: list[Sequence] = []  # added without a seed since the last step: drawn together
        # their seeds' source (config.seed); None: torch's global generator
        self._seed_source = torch.Generator().manual_seed(config.seed) if config.seed is not None else None
        self.async_scheduling = self._resolve_async_scheduling(config.async_scheduling)
        self._in_flight: InFlightStep | None = None  # async scheduling: the step launched last
        self._spec_in_flight = None  # pipelined speculative steps: the step launched last (pipelined.py)
        self._held_outputs: list[RequestOutput] = []  # read back outside step() (release_cuda_graphs)
        self._spec_serial = 0
        self._spec_results_at: float | None = None  # step_clock when the last pipelined step's results were back
        self._spec_read_back_at: float | None = None  # the same, for the step being finished (_finish_spec)
        self._draft_next = True  # adaptive speculation under async scheduling: the next step drafts
        self.num_result_waits = 0  # device-to-host waits for sampled tokens (async scheduling)
        self.warm_up_result = self._warm_up_requests(config.warm_up_requests)
        log.info("engine ready: %s on %s (%s), %d KV blocks of %d, attention=%s, spec=%s",
                 self.model_name, self.device, self.dtype, self.num_blocks, config.block_size, backend,
                 "on" if self.spec else "off")

    def _thinking_tag_ids(self, parser: str | None) -> tuple[int, int] | None:
        """reasoning_parser's (opening, closing) tags as token ids: the grammar waits for the closing
        one, so each must be one token of the vocabulary."""
        if parser is None:
            return None
        if self.tokenizer is None:
            raise ConfigError("reasoning_parser needs a tokenizer (this engine runs with skip_tokenizer_init)")
        from adaspec.reasoning_tags import REASONING_TAGS

        ids = []
        for tag in REASONING_TAGS[parser]:
            tid = self.tokenizer.token_to_id(tag)
            if tid is None:
                raise ConfigError(f"reasoning_parser {parser!r}: {tag!r} is not one token of this model's vocabulary "
                                  "(structured outputs wait for the end of the thinking as one token)")
            ids.append(tid)
        return ids[0], ids[1]

    @property
    def grammar_waits_for_thinking(self) -> bool:
        """Whether a constrained request's grammar waits for the end of its thinking (reasoning_parser)."""
        return self._thinking_tags is not None

    def _grammar_waits_for(self, params, prompt_ids: list[int]) -> int | None:
        """The token a request's structured output waits for: the end of the thinking, unless the
        prompt already closed it (Qwen3's template with thinking off writes <think></think>)."""
        if self._thinking_tags is None or params.structured_outputs is None:
            return None
        opening, closing = self._thinking_tags
        last = {t: i for i, t in enumerate(prompt_ids) if t in (opening, closing)}
        return None if last.get(closing, -1) > last.get(opening, -1) else closing

    def _warm_up_requests(self, asked: bool | None):
        """Dummy requests through step() before the engine is ready (engine/warm_up.py): by
        default where the engine compiles (CUDA graphs at tensor_parallel_size 1). -> WarmUpResult
        or None."""
        if asked is None:
            asked = self.use_cuda_graphs and self.tp is None
        if not asked:
            return None
        if self.tp is not None:
            raise ConfigError("warm_up_requests is not supported under tensor parallelism; leave it unset")
        from adaspec.engine.warm_up import warm_up_serving

        result = warm_up_serving(self)
        announce(f"warmed up the serving path with {result.requests} dummy requests ({result.steps} steps) "
                 f"in {result.seconds:.1f} s")
        return result

    def _resolve_async_scheduling(self, asked: bool | None) -> bool:
        """None ("auto"): on with CUDA at tensor_parallel_size 1: without speculation (plain steps
        launched before the previous one is read back), and with speculation when its step has
        CUDA graphs (pipelined speculative steps, spec_decode/pipelined.py, the measured step
        costs' included; adaptive verification without the speculative step's graphs runs the
        steps that do not draft async, as plain steps, when a decode graph serves them). Under
        tensor parallelism it works when asked for without speculation (the previous step's
        sampled tokens reach the workers in the mirrored call's device broadcast; CPU-tested with
        gloo), but is not the default until it has been measured on GPUs. Asked for with fixed-k
        speculation on an engine without the speculative step's graphs, it changes nothing (every
        step drafts from tokens on the host)."""
        why_not = None
        if self.spec is not None and self.tp is not None:
            why_not = "speculative decoding under tensor parallelism"
        if asked is None:
            if why_not is not None or self.device.type != "cuda" or self.tp is not None:
                return False
            if self.spec is None or self._pipelines_spec():
                return True
            # with speculation under cudagraph_mode FULL_DECODE_ONLY no graph serves a plain step
            # of many requests (the speculative step's own graphs serve drafting steps only)
            plain_graphed = not self.use_cuda_graphs or self.runner.graphs is not None
            return self.spec.cfg.enable_adaptive_verification and plain_graphed
        if asked and why_not:
            raise ConfigError(f"async_scheduling cannot be combined with {why_not}; leave it unset (auto) or "
                              "set it to False")
        return bool(asked)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (also done at interpreter exit); nothing to do otherwise.
        The CUDA graphs are freed first (Driver.before_leave), so the engine is unusable after."""
        if self.tp is not None:
            self.tp.shutdown()

    def release_cuda_graphs(self) -> int:
        """Free every captured CUDA graph (the target's and the speculative step's); later steps
        run eagerly. Under tensor parallelism this runs before the process group is left, on every
        rank: a live graph holding NCCL collectives makes destroy_process_group hang. -> how many."""
        if getattr(self, "_spec_in_flight", None) is not None:  # its replays use the graphs' buffers
            self._held_outputs += self._drain_spec()
        n = 0
        graphs = getattr(self.runner, "graphs", None)
        if getattr(self, "_decode_sampler", None) is not None:  # before the decode graphs whose logits it reads
            n += self._decode_sampler.release()
            self._decode_sampler = None
        if graphs is not None:
            n += graphs.release()
            self.runner.graphs = None
        spec = getattr(self, "spec", None)
        if spec is not None and spec.graphed is not None:
            n += spec.graphed.release()
            spec.use_graphs(None)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return n

    def _capture_graphs(self, drafter, lookahead: int) -> None:
        from adaspec.engine.cuda_graphs import GraphedForward, mixed_capture_sizes
        from adaspec.models.fused import use_compiled

        use_compiled()  # norms, RoPE, activation, residual adds: one kernel each inside the graphs

        mode = resolve_cudagraph_mode(self.config.cudagraph_mode, speculative=drafter is not None)
        mixed = mode == "FULL" and self.tp is None  # not yet under tensor parallelism
        # at TP 1 the speculative step captures its own decode graphs (spec_decode/graphed_step.py)
        spec_own_decode = drafter is not None and self.tp is None
        if spec_own_decode and not mixed:
            return
        # plain decode, and with cudagraph_mode FULL decodes with prefill chunks in one replay
        # (mixed graphs). With speculation at TP 1 the speculative step captures its own decode
        # graphs and these serve the steps' other rows: prefill chunks (on the H200 an eager
        # prefill forward of a 28-layer target took ~20 ms, several graphed steps). Under tensor
        # parallelism also verification (the graphed speculative step calls the model inside its
        # graphs, which the workers' mirrored calls cannot follow yet).
        k = drafter.spec_cfg.num_speculative_tokens if drafter and not spec_own_decode else 0
        bs = self.config.block_size
        # with its own decode graphs, one small decode graph here (for a split step's lone decode
        # row) instead of a [B, vocab] logits buffer per batch size; but adaptive speculation runs
        # the steps that do not draft as plain steps, for which the decode graphs are the fast
        # path (on the H200 a mixed graph's attention took 1.4x the decode graph's at 256 requests)
        plain_steps = drafter is not None and drafter.spec_cfg.enable_adaptive_verification
        graphs = GraphedForward(
            self.model, self.kv_caches, bs, self.device, self.config.max_num_seqs,
            batch_sizes=[1] if spec_own_decode and not plain_steps else None,
            query_lens=(1, k + 1) if k else (1,), max_model_len=self.max_model_len,
            max_blocks_per_seq=-(-(self.max_model_len + lookahead) // bs), scratch_block=self.scratch_block,
            capture_layers=list(drafter.drafter_cfg.target_layer_ids) if drafter else None,
            mixed_sizes=mixed_capture_sizes(self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                            self.max_model_len) if mixed else None,
            # the drafter's context from every row these graphs run (plain steps, prefill chunks)
            write_context=drafter.write_context if drafter is not None and self.tp is None else None,
        )
        graphs.capture()
        self.runner.graphs = graphs
        if self.tp is None:  # (under tensor parallelism rank 0's sampling stays eager: not measured there)
            from adaspec.engine.graphed_sampling import GraphedDecodeSampler

            t0 = time.perf_counter()
            sampler = GraphedDecodeSampler(graphs)
            try:
                sampler.capture()
            except (RuntimeError, torch.OutOfMemoryError) as e:  # an optimization: sample eagerly instead
                sampler.release()
                torch.cuda.synchronize(self.device)
                announce(f"WARNING: capturing the sampling graphs failed ({type(e).__name__}: {str(e)[:200]}); "
                         "plain decode steps sample eagerly after their graph")
                return
            self._decode_sampler = sampler
            announce(f"captured {len(sampler.graphs)} sampling graphs of the decode graphs in "
                     f"{time.perf_counter() - t0:.1f} s")

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        if request_id in self.requests or request_id in self.parallel.parents:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams", param="sampling_params")
        params.verify()  # fields are mutable: a value the step cannot use must fail here, for this request only
        if params.n > 1:
            self._add_parent(request_id, prompt, params, arrival_time)
            return
        if self.tokenizer is None and isinstance(prompt, str):
            raise InvalidRequestError("a text prompt needs a tokenizer, and this engine runs with "
                                      "skip_tokenizer_init=True: send the prompt as a list of token ids", param="prompt")
        if self.tokenizer is None and params.stop:
            raise InvalidRequestError("stop strings need a tokenizer, and this engine runs with "
                                      "skip_tokenizer_init=True: use stop_token_ids instead", param="stop")
        given_ids = None if isinstance(prompt, str) else token_ids(prompt)  # numpy integers taken too
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=True)  # a BOS, as vLLM
        elif given_ids is not None:
            text, ids = None, given_ids
            vocab = self.model_config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"prompt token id(s) {bad[:5]} outside the vocabulary [0, {vocab})", param="prompt")
        else:
            raise InvalidRequestError("prompt must be a string or a list of token ids", param="prompt")
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        ids = truncated_prompt(ids, params, self.max_model_len)
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len}: "
                f"shorten the prompt to at most {self.max_model_len - 1} tokens", param="prompt")
        try:
            seq = Sequence(request_id, text, ids, params, arrival_time)
        except ValueError as e:  # a seed outside the 64-bit range
            raise InvalidRequestError(str(e), param="seed") from None
        seq.logits_rule = LogitsRule.of(params, self.stop_checker.eos_token_ids, self.model_config.vocab_size,
                                        self.tokenizer, self._grammar_waits_for(params, ids))
        self.requests[request_id] = seq
        if seq.seed is None:
            self._unseeded.append(seq)
        self.scheduler.add(seq)

    def _add_parent(self, request_id: str, prompt, params: SamplingParams, arrival_time: float | None) -> None:
        """n samples as n child requests (engine/parallel_sampling.py); all of them or none."""
        parent = ParentRequest(request_id, params)
        taken = [cid for cid in parent.child_ids() if cid in self.requests or cid in self.parallel.parents]
        if taken:
            raise InvalidRequestError(f"request id {request_id!r}: its samples' ids {taken[:3]} are already in use",
                                      param="request_id")
        added = []
        try:
            for i, cid in enumerate(parent.child_ids()):
                self.add_request(cid, prompt, child_params(params, i), arrival_time)
                added.append(cid)
        except BaseException:
            for cid in added:  # not yet scheduled: gone without a trace
                seq = self.requests.pop(cid)
                self.scheduler.remove(seq)
                if seq in self._unseeded:
                    self._unseeded.remove(seq)
            raise
        self.parallel.add(parent)

    def abort_request(self, request_id: str) -> None:
        parent = self.parallel.parents.get(request_id)
        if parent is not None:  # every sample still running
            for i in sorted(parent.running):
                self.abort_request(child_request_id(request_id, i))
            return
        seq = self.requests.get(request_id)
        if seq is None or seq.finished:
            return
        strip_pending(seq)  # a token still on its way (async steps) is no part of the text
        self.stop_checker.finish_text(seq)  # before the finish reason: a final-only output has no text yet
        seq.finish_reason = "abort"
        self._finish(seq)
        self._aborted.append(seq)

    def has_unfinished_requests(self) -> bool:
        # a step in flight is read back by the next step() even when all its requests have ended
        return (self.scheduler.has_work() or bool(self._aborted) or self._in_flight is not None
                or self._spec_in_flight is not None or bool(self._held_outputs))

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def kv_blocks_total(self) -> int:
        return self.num_blocks

    def kv_blocks_free(self) -> int:
        return self.block_manager.num_free

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = step_clock()
        watch = self._slow_steps
        if watch is not None:
            self._last_shape = "nothing scheduled"
            watch.begin()
        try:
            return self.parallel.gather(self._step())
        finally:
            self.stats.time_in_steps += step_clock() - t0
            if watch is not None:
                watch.end(self._last_shape)

    def _step(self) -> list[RequestOutput]:
        outputs = self._held_outputs + [self._output(s, 0) for s in self._aborted]
        self._aborted, self._held_outputs = [], []
        if self._unseeded:  # in the order they were added, as one call per request would give
            for seq, seed in zip(self._unseeded, new_seeds(len(self._unseeded), self._seed_source)):
                seq.seed = seed
            self._unseeded = []
        outputs += self._read_back_for_grammars()
        if self.spec is not None and self.async_scheduling:
            if self._pipelines_spec():
                return outputs + self._pipelined_spec_step()
            outputs += self._drain_spec()  # the graphs were released since: no step stays in flight
            if self.spec.cfg.enable_adaptive_verification:
                return outputs + self._adaptive_async_step()
        scheduled = self.scheduler.schedule()
        self.stats.num_preemptions = self.scheduler.num_preemptions
        if self.async_scheduling and self.spec is None:
            return outputs + self._async_step(scheduled)
        if not scheduled:
            return outputs
        self._count_step(scheduled)
        if self.spec is None:  # the async step's launch and read back, with nothing in between
            return outputs + self._resolve(self._launch_plain_step(scheduled))
        return outputs + self._spec_step(scheduled)

    def _read_back_for_grammars(self) -> list[RequestOutput]:
        """A request with structured outputs needs its last token on the host to mask the next
        one (sample/structured_outputs.py): a step in flight that sampled for one is read back
        before the next step is scheduled, so such requests run without async overlap (the other
        requests of their steps too, while they last)."""
        outputs: list[RequestOutput] = []
        if self._in_flight is not None and _has_grammar(self._in_flight.seqs):
            outputs += self._resolve(self._in_flight)
            self._in_flight = None
        spec = self._spec_in_flight  # (a grammar's decoding rows are never pipelined: its prefill rows only)
        if spec is not None and spec.prefill is not None and _has_grammar(spec.prefill.seqs):
            self.stats.num_pipeline_drains += 1
            outputs += self._drain_spec()
        return outputs

    def _spec_step(self, scheduled: list[ScheduledSeq]) -> list[RequestOutput]:
        # each part of the step hands its rows' tokens over as soon as they are read back (in a
        # mixed step the graphed rows come first, while the GPU still runs the prefill chunks)
        by_row: dict[int, RequestOutput] = {}
        self.spec.step(scheduled, lambda indices, results: self._take_spec_tokens(scheduled, indices, results, by_row))
        return [by_row[i] for i in sorted(by_row)]  # in scheduling order, as a one-part step gives them

    # ---- pipelined speculative steps (spec_decode/pipelined.py) ----------------------------------
    def _pipelines_spec(self) -> bool:
        """Speculative steps are pipelined under async scheduling when the speculative step has its
        graphs (with measured step costs too: _time_spec_step times them; until H100 run 62 that
        setting ran the unpipelined _adaptive_async_step instead, whose drafting steps took
        1.4-2.1x the pipelined ones' wall on the real pair)."""
        return self.spec.graphed is not None

    def _pipelined_spec_step(self) -> list[RequestOutput]:
        """Schedule and launch this step, then read back and process the step launched before,
        while the GPU runs this one. A step that cannot be pipelined (a row the graphs do not
        serve, or blocks only a preemption would free) reads the step in flight back first."""
        outputs: list[RequestOutput] = []
        if self._in_flight is not None:  # a plain async step: a fused chunk step, or one from before the graphs existed
            plain = self._in_flight
            if self.spec.fuses_mixed_steps():
                # the next step, scheduled behind it: one with prompt chunks that the fused policy
                # runs plain is launched behind it before it is read back, as the plain engine's
                # steps are; any other is scheduled afresh below. So is one whose schedule admitted
                # a request or preempted: scheduled again with draft slots, the newcomer could lose
                # part of its prompt to them (against enable_chunked_prefill=False) or its blocks
                # to a preemption, which the policy's choice is not worth
                preempted, waiting = self.scheduler.num_preemptions, len(self.scheduler.waiting)
                scheduled = self.scheduler.schedule(drafts=False)
                self.stats.num_preemptions = self.scheduler.num_preemptions
                if scheduled and (self.scheduler.num_preemptions != preempted or len(self.scheduler.waiting) < waiting
                                  or self.spec.mixed_step_stays_plain(scheduled)):
                    self._count_step(scheduled)
                    self._in_flight = self._launch_plain_step(scheduled)
                    return outputs + self._resolve(plain)
            outputs += self._resolve(plain)
            self._in_flight = None
        prev, scheduled = self._spec_in_flight, None
        preempted = self.scheduler.num_preemptions
        if prev is not None:
            try:
                scheduled = self.scheduler.schedule(pipelined=True)
            except DrainFirst:
                scheduled = None
            if scheduled is not None and not self.spec.can_pipeline(scheduled):
                scheduled = None
            if scheduled is None:  # read it back, then schedule knowing every token
                self.stats.num_pipeline_drains += 1
                outputs += self._drain_spec()
                prev = None
        if scheduled is None:
            scheduled = self.scheduler.schedule()
        self.stats.num_preemptions = self.scheduler.num_preemptions
        if prev is not None:  # the policy's step time (launch to launch), before it plans the next step
            self.spec.policy.observe_step(1e3 * (time.perf_counter() - prev.launched_at))
        # the fused mode re-schedules a step it runs plain: not one whose schedule preempted (a
        # preemption for draft slots that the step then does not use would recompute for nothing)
        if scheduled and self.scheduler.num_preemptions == preempted and self.spec.decide_mixed(scheduled) is False:
            # a step with prompt chunks that the fused policy runs without drafts: one forward with
            # the chunks, as no-spec runs it (the pipelined step would run the rows beside them),
            # launched as the plain async step (read back in the next step, which may be another).
            # The speculative step in flight is read back first, and the rows are scheduled afresh
            # knowing every token, without draft slots: the chunks get the whole budget
            if prev is not None:
                self.stats.num_pipeline_drains += 1
                outputs += self._drain_spec()
                prev = None
            scheduled = self.scheduler.schedule(drafts=False)
            self._spec_in_flight = None
            self.spec.drop_mixed_decision()
            if scheduled:
                self._count_step(scheduled)
                self._in_flight = self._launch_plain_step(scheduled)
        elif scheduled:
            self._count_step(scheduled)
            if self.spec.can_pipeline(scheduled):
                self._spec_serial += 1
                self._spec_in_flight = self.spec.launch_pipelined(scheduled, prev, self._spec_serial,
                                                                  on_read_back=self._note_spec_read_back)
                self.stats.num_pipelined_steps += 1
            else:  # prev is None here: a synchronous step
                self._spec_in_flight = None
                outputs += self._spec_step(scheduled)
        else:
            self._spec_in_flight = None
        if prev is not None:
            outputs += self._finish_spec(prev)
        return outputs

    def _drain_spec(self) -> list[RequestOutput]:
        """Read back and process the pipelined speculative step in flight, if any."""
        step, self._spec_in_flight = self._spec_in_flight, None
        return self._finish_spec(step) if step is not None else []

    def _finish_spec(self, step) -> list[RequestOutput]:
        """A pipelined step's tokens: its graphed rows, then its prefill rows' sampled tokens, with
        the stop checks and outputs of a synchronous step (rows of requests that ended meanwhile
        are thrown away)."""
        by_row: dict[int, RequestOutput] = {}
        self._spec_read_back_at = None
        results = step.finish_graphed() if step.finish_graphed is not None else None  # (stamps its read back)
        if results is not None:
            self._take_spec_tokens(step.scheduled, step.graphed, results, by_row)
        if step.prefill is not None:
            tokens, lps = step.prefill.wait()
            self._note_spec_read_back()  # (after its chunks' forward and the graphed part's)
            self.num_result_waits += 1
            prefill_results = []
            for j, (seq, at) in enumerate(zip(step.prefill.seqs, step.prefill.indices)):
                if seq.finished:  # aborted while its first token was on its way
                    self.stats.num_discarded_rows += 1
                    prefill_results.append(([], None))
                    continue
                if seq.token_ids[at:] != [PENDING]:
                    raise RuntimeError(f"request {seq.request_id}: its placeholder is not its last token "
                                       "(pipelined bookkeeping is broken)")
                del seq.token_ids[at:]  # the stop checks append the real token
                prefill_results.append(([tokens[j]], [lps[j]] if lps is not None else None))
                self.stats.num_sampled_without_draft += 1
            self._take_spec_tokens(step.scheduled, step.prefill_rows, prefill_results, by_row)
        elif len(step.graphed) < len(step.scheduled):  # chunks that sample nothing: never waited for
            self._spec_read_back_at = None
        self._time_spec_step(step, results)
        return [by_row[i] for i in sorted(by_row)]

    def _note_spec_read_back(self) -> None:
        """A pipelined step's results reached the host (called right after the read back, before
        any bookkeeping on them, so no step's host work enters another's wall)."""
        self._spec_read_back_at = step_clock()

    def _time_spec_step(self, step, results) -> None:
        """Measured step costs under pipelining, once `step` was read back. Its wall is the time
        from the previous step's results to its own: launched behind that step, it ran on the GPU
        right after it (launch to launch would be the previous step's GPU time: the loop launches
        a step, then waits for the one before). _spec_read_back_at is None when some of the step's
        GPU work was never waited for (prompt chunks that sample nothing): then neither it nor the
        next step is timed. A step whose chunks sample is stamped at their wait, after its graphed
        rows' bookkeeping: late by whatever of that bookkeeping outlasts the chunks' forward (none
        once the forward is the longer). results: its graphed rows' (tokens, logprobs)."""
        now = self._spec_read_back_at
        last, self._spec_results_at = self._spec_results_at, now
        if step.cost_kind is None or not step.behind or last is None or now is None or results is None:
            return
        kind, num_requests = step.cost_kind
        self.spec.policy.step_costs.observe(kind, num_requests, 1e3 * (now - last),
                                            sum(len(tokens) for tokens, _ in results))

    def _adaptive_async_step(self) -> list[RequestOutput]:
        """Adaptive speculation under async scheduling. A step the policy lets draft runs as a
        speculative step (synchronous: its drafts start from tokens on the host, so a plain step
        still in flight is read back first); a step it skips runs as the plain engine's async
        step (launched before the previous one is read back, the drafter's context written on
        the device), and so do the steps after it, scheduled without draft slots and without
        asking the policy, until its next probe drafts (policy.plain_step_done). It times both
        kinds (policy.step_started; spec_decode/step_costs.py)."""
        policy = self.spec.policy
        outputs: list[RequestOutput] = []
        was_drafting = self._draft_next
        if was_drafting and self._in_flight is not None:
            outputs = self._resolve(self._in_flight)
            self._in_flight = None
            policy.step_started(time.perf_counter(), measure_previous=False)  # this step waited for it
        else:
            policy.step_started(time.perf_counter())
        scheduled = self.scheduler.schedule(drafts=was_drafting)
        self.stats.num_preemptions = self.scheduler.num_preemptions
        decision = self.spec.decide_drafting(scheduled) if was_drafting and scheduled else None
        # a skip for the step's prompt chunks (the fused mode's margin) holds for that step only;
        # judged before the step runs (it moves the rows' computed tokens)
        chunked = decision is False and self.spec.chunks_decided(scheduled)
        if decision:
            self._count_step(scheduled)
            outputs += self._spec_step(scheduled)
        else:
            launched = None
            if scheduled:
                self._count_step(scheduled)
                # the first of a run is not timed: the next step waits for its GPU work
                measured = policy.step_costs is not None  # only the measured policy counts the rows
                policy.plan_plain(len(scheduled), sum(s.num_tokens for s in scheduled), timed=self._in_flight is not None,
                                  tokens=sum(1 for s in scheduled if s.samples) if measured else None)
                launched = self._launch_plain_step(scheduled)
                self.stats.num_steps_draft_skipped += decision is False or not was_drafting
            previous, self._in_flight = self._in_flight, launched
            if previous is not None:
                outputs += self._resolve(previous)
        if not scheduled:
            policy.idle()
            self._draft_next = True
        elif was_drafting:  # drafted: keep drafting; skipped: plain from now on; nothing to draft: ask again
            self._draft_next = decision is not False or chunked
        else:
            self._draft_next = policy.plain_step_done(len(scheduled))
        return outputs

    def _take_spec_tokens(self, scheduled: list[ScheduledSeq], indices: list[int], results: list,
                          by_row: dict[int, RequestOutput]) -> None:
        """Stop checks and outputs for the rows `indices` of a speculative step."""
        t1 = time.perf_counter()
        now = time.monotonic()
        append, generated = self.stop_checker.append, 0  # (a loop over every row, every step)
        for i, (tokens, lps) in zip(indices, results):
            seq = scheduled[i].seq
            if not tokens:
                continue
            if seq.first_token_time is None:
                seq.first_token_time = now
            n = append(seq, tokens, lps)
            generated += n
            if seq.finish_reason is not None:
                self._finish(seq)
            elif seq.params.output_kind is RequestOutputKind.FINAL_ONLY:
                continue
            by_row[i] = self._output(seq, n)
        self.stats.num_generated_tokens += generated
        self.stats.time_bookkeeping += time.perf_counter() - t1

    def _count_step(self, scheduled: list[ScheduledSeq]) -> None:
        self.stats.num_steps += 1
        if self._slow_steps is not None:
            self._last_shape = step_shape(scheduled)
        prompt_tokens = 0
        for s in scheduled:  # before the step moves num_computed_tokens; a decoding row adds 0
            left = len(s.seq.prompt_token_ids) - s.seq.num_computed_tokens
            if left > 0:
                prompt_tokens += min(s.num_tokens, left)
        self.stats.num_prompt_tokens += prompt_tokens

    # ---- the plain step: launch, then read back (engine/async_step.py) ----------------------
    # Synchronous: step() reads back the step it just launched. Async: it launches step t and
    # reads back step t-1, whose sampled tokens step t took on the device.
    def _async_step(self, scheduled: list[ScheduledSeq]) -> list[RequestOutput]:
        """Launch this step, then read back and process the previous one while the GPU runs it."""
        launched = None
        if scheduled:
            self._count_step(scheduled)
            launched = self._launch_plain_step(scheduled)
        previous, self._in_flight = self._in_flight, launched
        return self._resolve(previous) if previous is not None else []

    def _launch_plain_step(self, scheduled: list[ScheduledSeq]) -> InFlightStep:
        t0 = time.perf_counter()
        prev = self._in_flight
        prev_rows = prev.rows if prev is not None else {}
        items, sampling, pending = [], [], []
        needs_prev = False  # some item reads the previous step's tokens (under TP they are broadcast)
        ruled = False  # some sampling row has a logits rule (sample/logits_rules.py)
        prompt_chunks, sample_items = [], []  # (seq, nc, n, item) of chunks recording prompt logprobs; sampling items
        for s in scheduled:
            seq, nc = s.seq, s.seq.num_computed_tokens
            ids = seq.token_ids[nc:nc + s.num_tokens]
            prev_row = -1
            if ids[-1] == PENDING:  # its last token is still on the device, in the previous step's output
                prev_row = prev_rows.get(id(seq), -1)
                if prev_row < 0 or PENDING in ids[:-1]:
                    raise RuntimeError(f"request {seq.request_id}: a placeholder token that no step in flight "
                                       "will fill (async scheduling bookkeeping is broken)")
                needs_prev = True
            samples = nc + s.num_tokens == len(seq.token_ids)  # ScheduledSeq.samples, inlined: a hot loop
            if samples:
                sampling.append(seq)
                sample_items.append(len(items))
                pending.append(prev_row)
                ruled = ruled or seq.logits_rule is not None
            num_logits = int(samples)
            if seq.prompt_logprobs is not None:
                num_logits = logits_rows(seq, nc, s.num_tokens, samples)
                if num_logits > int(samples):  # (a 1-token chunk mid-prompt asks for 1 row too)
                    prompt_chunks.append((seq, nc, s.num_tokens, len(items)))
            items.append(ForwardItem(ids, nc, seq.block_table, num_logits, prev_row))
        capture = self.spec.capture_layers if self.spec is not None else None
        res = self.runner.execute(items, capture, prev_tokens=prev.tokens if needs_prev else None)
        if self.spec is not None:  # a step of adaptive speculation that does not draft
            self.spec.write_context(scheduled, [s.num_tokens for s in scheduled], res)
        t1 = time.perf_counter()
        raw = res.logits  # one row per sampling item (logprobs report these), unless prompt chunks asked for more
        if prompt_chunks:
            raw = sampling_logits(res.logits, items, prompt_chunks, sample_items)
        logits = raw  # with the rows' rules applied (raw: their grammars' masks only, what logprobs show)
        if ruled:  # (a last token still on the device is counted from the step in flight's output)
            raw, logits = logits_with_rules(raw, rows_of(sampling, pending=pending),
                                            prev.tokens if prev is not None else None)
        if not sampling:
            chosen = torch.zeros(0, dtype=torch.int64, device=res.logits.device)
        elif all(s.params.greedy for s in sampling):
            chosen = logits.argmax(-1)
        else:
            batch = self._plain_sampling.get(sampling, res.logits.device)
            chosen = None
            # every row a sampling decode without a rule: the graphed sampler samples raw logits
            if (self._decode_sampler is not None and len(sampling) == len(scheduled) and not ruled
                    and not prompt_chunks):
                chosen = self._decode_sampler.sample(res.graph_key, res.logits, batch)
            if chosen is None:
                chosen = self._sample_on_device(logits, sampling, batch, ruled=True)
        want = [s.params.logprobs for s in sampling]
        lp_tensors = ()
        if any(w is not None for w in want):
            lp_tensors = logprobs_of(raw, chosen, max(w or 0 for w in want))
        for s in scheduled:
            s.seq.num_computed_tokens += s.num_tokens
        self.stats.num_sampled_without_draft += len(sampling)
        self.stats.time_verify += t1 - t0
        self.stats.time_sample += time.perf_counter() - t1
        return InFlightStep.launch(sampling, chosen, lp_tensors, want)

    def _resolve(self, step: InFlightStep) -> list[RequestOutput]:
        """Put a step's tokens in place of its placeholders, with the stop checks of a synchronous step."""
        tokens, lps = step.wait()
        self.num_result_waits += 1
        t1 = time.perf_counter()
        now = time.monotonic()
        outputs = []
        for i, (seq, at) in enumerate(zip(step.seqs, step.indices)):
            if seq.finished:  # aborted, or stopped a step earlier: this row was computed for nothing
                self.stats.num_discarded_rows += 1
                # counted at launch; the kept tokens only, as a speculative step's read back counts
                # them (generated = accepted + bonus + sampled without draft, on every path)
                self.stats.num_sampled_without_draft -= 1
                continue
            later = seq.token_ids[at + 1:]  # the placeholder of a step launched since
            del seq.token_ids[at:]
            if seq.first_token_time is None:
                seq.first_token_time = now
            n = self.stop_checker.append(seq, [tokens[i]], [lps[i]] if lps is not None else None)
            self.stats.num_generated_tokens += n
            if seq.finish_reason is not None:
                self._finish(seq)
            elif seq.params.output_kind is RequestOutputKind.FINAL_ONLY:
                seq.token_ids.extend(later)
                continue
            outputs.append(self._output(seq, n))
            if not seq.finished:
                seq.token_ids.extend(later)
        self.stats.time_bookkeeping += time.perf_counter() - t1
        return outputs

    def sample(self, logits: torch.Tensor, seqs: list[Sequence], batch: SamplingBatch | None = None):
        """One token per row of logits, for each request's next position (len(token_ids)).
        -> (tokens: list[int], logprobs: list[dict] | None)."""
        shown, logits = logits_with_rules(logits, rows_of(seqs))
        chosen = self._sample_on_device(logits, seqs, batch, ruled=True)
        tokens = chosen.tolist()
        return tokens, self.logprob_dicts(shown, chosen, tokens, [s.params.logprobs for s in seqs])

    @staticmethod
    def _sample_on_device(logits: torch.Tensor, seqs: list[Sequence], batch: SamplingBatch | None = None,
                          ruled: bool = False):
        """The chosen token of every row, left on the device (no sync). The rows' logits rules
        are applied first (ruled: the caller did)."""
        if not ruled:
            rows = rows_of(seqs)
            if rows is not None:
                logits = apply_logits_rules(logits, rows)
        if batch is None and all(s.params.greedy for s in seqs):  # no sampling tensors needed at all
            return logits.argmax(-1)
        if batch is None:
            batch = SamplingBatch.build([s.params for s in seqs], [s.seed for s in seqs], logits.device)
        positions = to_device([len(s.token_ids) for s in seqs], logits.device, torch.int64)
        return sample_categorical(batch.probs(logits), keyed_uniforms(batch.seeds, positions, SAMPLE))

    @staticmethod
    def logprob_dicts(logits: torch.Tensor, chosen: torch.Tensor, tokens: list[int],
                      want: list[int | None]) -> list[dict] | None:
        """OpenAI-style logprobs per row: the top-n ({token: logprob}) plus the chosen token
        (chosen on the device, tokens its host copy)."""
        if all(w is None for w in want):
            return None
        c_lp, top_ids, top_lp = logprobs_of(logits, chosen, max(w or 0 for w in want))
        return logprob_dicts(tokens, c_lp.tolist(), top_ids.tolist(), top_lp.tolist(), want)

    # ---- outputs ------------------------------------------------------------------------
    def _finish(self, seq: Sequence) -> None:
        strip_pending(seq)  # async scheduling: tokens of steps in flight that will never be read
        seq.status = SequenceStatus.FINISHED
        self.scheduler.remove(seq)
        self.requests.pop(seq.request_id, None)
        # its grammar's matcher and its penalty counts' row back to their pools now (when the
        # states are dropped), not when the Sequence is: a step, a cache or a cycle may hold finished
        # Sequences for a while, and every matcher still lent makes a later request of that grammar
        # compile one of its own, every row still held grows the counts (0.76 MB a row at 152k)
        seq.grammar_state = seq.logits_rule_state = None
        self.stats.num_requests_finished += 1
        if self.spec is not None:
            self.spec.forget(seq)

    def _output(self, seq: Sequence, num_new: int) -> RequestOutput:
        if seq.params.output_kind is RequestOutputKind.NEW_TOKENS:  # this step's tokens only ([] for 0)
            token_ids = seq.token_ids[len(seq.token_ids) - num_new:]
            logprobs = None if seq.logprobs is None else seq.logprobs[len(seq.logprobs) - num_new:]
        else:
            token_ids = seq.output_token_ids  # a fresh list (a slice)
            logprobs = list(seq.logprobs) if seq.logprobs is not None else None
        comp = CompletionOutput(
            index=0, text=seq.output_text, token_ids=token_ids,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, logprobs=logprobs,
        )
        prompt_lps = seq.prompt_logprobs  # once every prompt token has its entry
        complete = prompt_lps is not None and len(prompt_lps) == len(seq.prompt_token_ids)
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.prompt_token_ids,
            outputs=[comp], finished=seq.finished, arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time, num_new_tokens=num_new,
            # the request's own lists, not copies: complete, they no longer change (a copy per
            # output was O(prompt) work every step of a streamed request)
            prompt_logprobs=prompt_lps if complete else None,
            prompt_logprob_ranks=seq.prompt_logprob_ranks if complete else None,
        )
