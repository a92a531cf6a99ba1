"""Engine configuration, validated once at start (vLLM's engine-argument names)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any

from adaspec.errors import ConfigError


CUDAGRAPH_MODES = ("FULL_DECODE_ONLY", "FULL", "NONE")

# a field's annotation -> (the check of its value, what the error says it must be). A flag given
# as the string "false" would otherwise count as true, and True as the integer 1
_TYPE_CHECKS = {
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
}


def check_field_types(config: Any, what: str, strings: bool = False) -> None:
    """Every bool, int and float field of a config dataclass (optional ones may also be None), and
    with strings=True every str field (a path-like object too), holds a value of its type: a
    ConfigError naming the field otherwise. (strings is for configs read from JSON: in Python an
    engine argument such as dtype may be given as a torch dtype.)"""
    checks = {**_TYPE_CHECKS, "str": (lambda v: isinstance(v, (str, os.PathLike)), "a string")} if strings \
        else _TYPE_CHECKS
    for f in fields(config):
        kind = str(f.type)
        optional = kind.endswith(" | None")
        check = checks.get(kind[: -len(" | None")] if optional else kind)
        v = getattr(config, f.name)
        if check is None or (optional and v is None):
            continue
        ok, must = check
        if not ok(v):
            raise ConfigError(f"{what} {f.name} must be {must}{' or null' if optional else ''}, got {v!r}")


# vLLM's other spellings of a dtype (str(torch.float16) is "torch.float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32", "torch.float16": "float16", "torch.float32": "float32",
                 "torch.bfloat16": "bfloat16"}

# vLLM engine arguments accepted at the values that change nothing here (dropped), refused at others
NEUTRAL_ENGINE_ARGS = {
    "trust_remote_code": lambda v: isinstance(v, bool),  # no model code is ever loaded from a checkpoint
    "disable_log_stats": lambda v: isinstance(v, bool),
    "enable_prefix_caching": lambda v: v in (None, False),
    "quantization": lambda v: v is None,
    "kv_cache_dtype": lambda v: v == "auto",
    "tokenizer_mode": lambda v: v == "auto",
    "revision": lambda v: v is None,
    "tokenizer_revision": lambda v: v is None,
}
NEUTRAL_ENGINE_ARGS_HELP = {
    "trust_remote_code": "a bool: adaspec runs its own model code only",
    "disable_log_stats": "a bool",
    "enable_prefix_caching": "there is no prefix cache: False or None only",
    "quantization": "no quantization: None only",
    "kv_cache_dtype": "the KV cache has the model's dtype: 'auto' only",
    "tokenizer_mode": "the directory's tokenizer.json: 'auto' only",
    "revision": "checkpoints are local directories: None only",
    "tokenizer_revision": "checkpoints are local directories: None only",
}


def resolve_cudagraph_mode(asked: str | None, speculative: bool) -> str:
    """cudagraph_mode as the engine runs it: what was asked for, else FULL, with or without
    speculation (EngineConfig.cudagraph_mode says why). ``speculative`` is kept so that callers
    state which engine asks, and a later default may differ by it again."""
    del speculative  # one default since both engines' mixed graphs passed their GPU tests (run 8)
    return asked or "FULL"


@dataclass
class EngineConfig:
    model: str  # HF model directory or an embedded model name ("tiny")
    tokenizer: str | None = None  # defaults to the model directory
    # token ids in and out, no tokenizer loaded (vLLM's name): text prompts and stop strings are refused
    skip_tokenizer_init: bool = False
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 ("auto": bf16 on CUDA, f32 on CPU)
    load_format: str = "auto"  # auto | safetensors | dummy (random weights of the configured shape, for timing)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit KV block count (overrides kv_cache_memory)
    kv_cache_memory: int | None = None  # bytes for the KV cache; default: 1 GiB CPU, 30% of free on CUDA
    gpu_memory_utilization: float | None = None  # vLLM's: GPU fraction for weights + KV (CUDA only)
    attention_backend: str = "auto"  # auto | reference | varlen
    enforce_eager: bool = False  # True: no CUDA graphs (graphs need CUDA and the triton attention backend)
    # vLLM's compilation_config cudagraph_mode values that apply here: FULL (graphs for decode and
    # verification steps, and for steps with prefill chunks: engine/cuda_graphs.py's mixed graphs,
    # at tensor_parallel_size 1; under TP the same as FULL_DECODE_ONLY), FULL_DECODE_ONLY
    # (decode and verification steps only; prefill chunks run eagerly), NONE (as enforce_eager).
    # None: FULL (on the H200 a step with a 128-token prompt chunk took 1.2-1.4x a decode step as
    # one mixed graph and 2-13x split: BENCHMARKS.md, run 7; the speculative engine's mixed graphs
    # equal eager with arrivals on the H200 since run 8)
    cudagraph_mode: str | None = None
    # False: each prompt runs in one step, so max_num_batched_tokens must hold max_model_len tokens
    # (less max_num_seqs * k with reserve_all_spec_slots): a ConfigError otherwise, as in vLLM
    enable_chunked_prefill: bool = True
    # schedule and launch step t while the GPU runs step t-1 (vLLM's name; engine/async_step.py).
    # None: on where it applies (CUDA, tensor_parallel_size 1; with speculation where its step has
    # CUDA graphs: pipelined speculative steps; LLMEngine._resolve_async_scheduling)
    async_scheduling: bool | None = None
    # vLLM's engine seed: the random seeds of requests that bring none are drawn from a generator
    # seeded with it, so a run's unseeded requests repeat from run to run (vLLM V1's default 0
    # too); None: drawn from torch's global generator (torch.manual_seed decides)
    seed: int | None = 0
    # vLLM's: where requests' sampling defaults come from: "auto", the model's generation_config.json
    # (its temperature, top_p, top_k; models/generation_defaults.py), "vllm" SamplingParams' own, or
    # a directory holding a generation_config.json
    generation_config: str = "auto"
    # dummy requests through the step path before the engine is ready, so that torch.compile's
    # first-use compiles do not stall the first real requests (engine/warm_up.py). None: on where
    # the engine compiles (CUDA graphs on, tensor_parallel_size 1)
    warm_up_requests: bool | None = None
    # vLLM's: a thinking model's tags (adaspec/reasoning_tags.py); a request's structured output then
    # holds only after the end of its thinking, as vLLM's structured outputs wait for it
    reasoning_parser: str | None = None
    tensor_parallel_size: int = 1  # ranks (GPUs of one host; CPU processes) sharing the model (adaspec/distributed)
    speculative_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, str):
            try:
                self.speculative_config = json.loads(self.speculative_config)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config is not valid JSON: {e}") from None
        if self.speculative_config is not None and not isinstance(self.speculative_config, dict):
            v = self.speculative_config
            kind = ("a JSON list" if isinstance(v, (list, tuple)) else "a JSON string" if isinstance(v, str)
                    else "a JSON true/false" if isinstance(v, bool) else "a JSON number" if isinstance(v, (int, float))
                    else type(v).__name__)
            raise ConfigError(f"speculative_config must be a JSON object (e.g. {{\"method\": \"dspark\"}}), got {kind}")
        check_field_types(self, "engine argument")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ConfigError(f"generation_config must be 'auto', 'vllm' or a directory, got {self.generation_config!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ConfigError(f"seed must be a 64-bit integer or null, got {self.seed!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        for name in ("max_model_len", "num_kv_blocks", "kv_cache_memory"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if self.reasoning_parser is not None:
            from adaspec.reasoning_tags import REASONING_TAGS

            if self.reasoning_parser not in REASONING_TAGS:
                raise ConfigError(f"reasoning_parser must be one of {sorted(REASONING_TAGS)}, got {self.reasoning_parser!r}")
        if self.warm_up_requests is not None and not isinstance(self.warm_up_requests, bool):
            raise ConfigError(f"warm_up_requests must be true, false or unset, got {self.warm_up_requests!r}")
        g = self.gpu_memory_utilization
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 < g <= 1):
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {g!r}")
        self.dtype = DTYPE_ALIASES.get(str(self.dtype), self.dtype)  # vLLM's spellings, torch dtypes too
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be one of auto, float32, bfloat16, float16 (or vLLM's half, float); "
                              f"got {self.dtype!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ConfigError(f"load_format must be one of auto, safetensors, dummy; got {self.load_format!r}")
        if self.cudagraph_mode is not None and self.cudagraph_mode not in CUDAGRAPH_MODES:
            hint = " (piecewise graphs are not implemented)" if "PIECEWISE" in str(self.cudagraph_mode) else ""
            raise ConfigError(f"cudagraph_mode must be one of {', '.join(CUDAGRAPH_MODES)}; got "
                              f"{self.cudagraph_mode!r}{hint}")
        if self.attention_backend not in ("auto", "reference", "varlen", "triton"):
            raise ConfigError(
                f"attention_backend must be one of auto, reference, varlen, triton; got {self.attention_backend!r}"
            )

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "EngineConfig":
        for name, ok in NEUTRAL_ENGINE_ARGS.items():  # vLLM's, asking for nothing adaspec would do otherwise
            if name in kwargs:
                v = kwargs.pop(name)
                if not ok(v):
                    raise ConfigError(f"engine argument {name}={v!r} is not supported by adaspec "
                                      f"({NEUTRAL_ENGINE_ARGS_HELP[name]})")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine argument(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(model=model, **kwargs)


@dataclass
class SpeculativeConfig:
    """`speculative_config` with vLLM's key names (plus a few of our own, documented here)."""

    method: str = "dspark"
    model: str | None = None  # drafter directory or embedded name; default: the target's shipped drafter
    num_speculative_tokens: int | None = None  # k; default: the drafter's block_size
    draft_sample_method: str = "probabilistic"  # "greedy" | "probabilistic"
    enable_adaptive_verification: bool = False
    adaptive_verification_ema_alpha: float | None = None  # EMA over per-request confidences (off)
    # ours:
    # ms every candidate step pays beyond the cost tables (host, prefill chunks riding along), or
    # "measured": tracked online as (step wall time - the tables' price), spec_decode/step_overhead.py.
    # 0 (default): the tables alone, as vLLM's adaptive verification prices steps, and a budget that
    # depends on no wall clock. "measured" made 1.00-1.07x the tables alone's output throughput on
    # two builds of the code-0.6b pair (H100 runs 72 and 73, T = 1, 64-256 requests, means of 3
    # repeats), but on the Qwen3-8B shape at 256 requests (run 74, T = 0, synthetic acceptance) its
    # estimate ran up to 4-11 ms and the arm made 0.86x and 0.96x no-spec in its two repeats, where
    # the tables alone had made 0.977x (run 71): opt-in until its estimate is sound there. Those runs
    # floored each sample at 0; the average is now floored instead (step_overhead.py says why): on
    # the 8B shape (run 75) it made 1.024x the tables alone with output lengths 32-96, 0.986x with 64;
    # on the pair (H200 run 76, T = 1) it ended every point at 0 (the tables priced above the steps'
    # wall there) and tied the tables alone: 1.025x at 64 requests, 0.997x at 256
    adaptive_verification_step_overhead_ms: float | str = 0.0
    # whether drafting pays in a step is judged on the cost tables alone ("tables", as vLLM), or on
    # the tokens per request per ms that each kind of step (drafting; plain, async where the engine
    # schedules async) has really made at this batch-size bucket ("measured", spec_decode/step_costs.py;
    # the tables until both kinds were measured there, probes of both kinds keep them fresh). Opt-in
    # until measured on the real pair (BENCHMARKS.md, run 11): its first version (the tables scaled
    # by measured wall / priced ratios) chose plain steps at 16 requests where drafting made more
    adaptive_verification_step_costs: str = "tables"
    # how many of the k slots the adaptive step drafts: all of them ("full"), or ("budget") one of
    # about k/4, k/2, k (policy.draft_widths; graphed and eager steps alike), chosen with the
    # budget from the old confidences (so the cap depends on no current draft: lossless): the
    # cost tables time every width's draft, and the policy weighs each width with every request
    # capped at it (policy.width_capped_objective), so a loaded step may draft 2 slots of every
    # request as a short fixed k does; the vocabulary projection and Markov steps of the slots
    # left out are saved. Every 16th such step drafts all k, so slots past the width get fresh
    # confidences. Opt-in: on the H100 (BENCHMARKS.md, run 71) within the spreads of the full
    # width on the code-0.6b pair, and below it on the Qwen3-8B shape at 256 requests (it drafted
    # nearly every step there and ran more steps with prompt chunks).
    adaptive_draft_width: str = "full"
    # scale the budget's survivals, per draft position, by accepted / predicted over the recent
    # verified drafts (spec_decode/online_calibration.py), so B* follows what the target accepts on
    # the served traffic. Opt-in: measured once on a GPU, without a comparison arm (H200 run 25: the
    # raw confidences already predicted the served acceptance there); built after H200 run 24, where at T = 1
    # the served drafts were accepted 0.80-0.87x as often as the held-out calibration promised)
    adaptive_verification_online_calibration: bool = False
    # what the budget takes for the confidences of a request no step has drafted for yet (a new
    # one, or one only plain steps ran): 1.0 per slot ("one", vLLM's optimism), or the running
    # average of the confidences observed so far ("population"). null: "population" with measured
    # step costs or with adaptive_verification_mixed_steps "fused", else "one". Why it matters:
    # under steady arrivals a few rows per step are new, and at 1.0 each one promises k accepted
    # drafts, which can tip a high-load step into drafting where
    # plain steps make more (H200 run 37, T = 1 at 256 requests: adaptive drafted in 119 of 124 steps
    # where the replay over real confidences prices a plain step higher). Left at "one": measured on
    # one build (H200 run 38, offline frontier, 3 repeats) "population" changed nothing beyond the
    # spreads at T = 0 and at 1-64 requests at T = 1, and at 256 requests, T = 1 it skipped drafting
    # in 22-30 steps instead of 10-13 and made 1.1% less (44,309 +- 79 against 44,792 +- 129 tok/s).
    # "fused" takes "population": its plain chunk steps draft for no new request, so a whole wave of
    # them reaches its first decode-only steps unobserved, and at 1.0 each the Qwen3-8B shape at 256
    # requests verified all 7 slots of every row in its first two (65 ms each against 11 ms plain,
    # ~13 tokens per ms against ~23), which also reset the probe interval (H200 run 43, --step-trace)
    adaptive_verification_unobserved_confidence: str | None = None
    # a step that carries prompt chunks beside decoding rows: "separate" prices the rows' drafting
    # by the decode tables alone and runs them, drafting or not, beside the chunks' own forward (the
    # graphed pipelined step); "fused" judges drafting there at the margin (policy.mixed_step_drafts:
    # its expected extra tokens against what its extra time makes in decode-only steps) and runs a
    # step it does not draft as ONE forward with the chunks (the plain engine's mixed graphs), as
    # no-spec does. Why: on the Qwen3-8B shape at 256 requests the speculative arms lost their point
    # in such steps, 30 of ~100 ms each against no-spec's 24 of 94 (H200 run 41). Opt-in: on the
    # real code-0.6b pair it made 20-43% less than "separate" at 64-256 requests (H100 run 50; the
    # tables' decode-only rate, which no real step reaches, kept every chunk step plain). With
    # adaptive_verification_step_costs "measured" the margin values the extra time at the rate the
    # engine's decode-only steps measured instead (policy.mixed_step_terms: on runs 50 and 60's
    # figures, read on the CPU, that drafts beside chunks on the pair and not on the 8B shape;
    # the bench arm adaptive-fused-measured:K). Run on the pair (H100 run 62) that arm lost 24-35%
    # to "separate" at 1-256 requests: measured step costs then turned off the pipelined step, which
    # made its drafting steps 1.4-2.1x longer, whatever the margin decided. Pipelined since: on the
    # 8B shape at 256 requests (H100 run 63) it made 0.976x no-spec, as "fused" on the tables did
    # (0.975x), where drafting does not pay and the drafter's context over every token is the gap
    adaptive_verification_mixed_steps: str = "separate"
    profile_context_len: int = 256  # context length of the dummy steps that build the cost tables
    profile_repeats: int = 9  # runs per shape (median); cheap: ~1 s of startup for 38 shapes on the H200
    cost_model_cache_dir: str | None = None  # default ~/.cache/adaspec/cost_models
    reserve_all_spec_slots: bool = False  # pre-v0.28 token budget: max_num_seqs * k reserved up front
    # method "synthetic" only (spec_decode/synthetic.py; timing studies, the output is not the target's):
    synthetic_acceptance: list[float] | None = None  # P(accept draft j | drafts < j accepted), j = 0..k-1
    synthetic_confidence_noise: float = 0.05  # std of the noise added to the confidences the policy sees
    synthetic_drafter: dict[str, Any] | None = None  # stand-in drafter's shape: num_layers, markov_rank

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SpeculativeConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"speculative_config must be a JSON object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(
                f"unknown speculative_config key(s): {', '.join(unknown)}; known keys: {', '.join(sorted(known))}"
            )
        c = cls(**d)
        check_field_types(c, "speculative_config key", strings=True)
        if c.method not in ("dspark", "synthetic"):
            raise ConfigError(f"speculative method {c.method!r} is not supported; use \"method\": \"dspark\" "
                              "(or \"synthetic\" for timing studies)")
        k = c.num_speculative_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ConfigError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        if c.draft_sample_method not in ("greedy", "probabilistic"):
            raise ConfigError(
                f"draft_sample_method must be \"greedy\" or \"probabilistic\", got {c.draft_sample_method!r}"
            )
        a = c.adaptive_verification_ema_alpha
        if a is not None and not (isinstance(a, (int, float)) and 0 < a <= 1):
            raise ConfigError(f"adaptive_verification_ema_alpha must be in (0, 1], got {a!r}")
        o = c.adaptive_verification_step_overhead_ms
        if o != "measured" and (isinstance(o, bool) or not isinstance(o, (int, float)) or not o >= 0):
            raise ConfigError(f"adaptive_verification_step_overhead_ms must be a number of ms >= 0 or \"measured\", "
                              f"got {o!r}")
        if not isinstance(c.adaptive_verification_online_calibration, bool):
            raise ConfigError("adaptive_verification_online_calibration must be true or false, got "
                              f"{c.adaptive_verification_online_calibration!r}")
        if c.adaptive_draft_width not in ("full", "budget"):
            raise ConfigError(f"adaptive_draft_width must be \"full\" or \"budget\", got {c.adaptive_draft_width!r}")
        if c.adaptive_verification_unobserved_confidence not in (None, "one", "population"):
            raise ConfigError("adaptive_verification_unobserved_confidence must be \"one\", \"population\" or null, "
                              f"got {c.adaptive_verification_unobserved_confidence!r}")
        if c.adaptive_verification_mixed_steps not in ("separate", "fused"):
            raise ConfigError("adaptive_verification_mixed_steps must be \"separate\" or \"fused\", got "
                              f"{c.adaptive_verification_mixed_steps!r}")
        if c.adaptive_verification_step_costs not in ("measured", "tables"):
            raise ConfigError("adaptive_verification_step_costs must be \"measured\" or \"tables\", got "
                              f"{c.adaptive_verification_step_costs!r}")
        for name in ("profile_context_len", "profile_repeats"):
            if getattr(c, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(c, name)!r}")
        if c.method == "synthetic":
            from adaspec.spec_decode.synthetic import validate_config

            validate_config(c)
        else:
            given = [n for n in ("synthetic_acceptance", "synthetic_drafter") if d.get(n) is not None]
            given += ["synthetic_confidence_noise"] if "synthetic_confidence_noise" in d else []
            if given:
                raise ConfigError(f"speculative_config key(s) {', '.join(given)} need \"method\": \"synthetic\"")
        return c
