"""`adaspec serve MODEL`: the OpenAI-compatible HTTP server (flags follow `vllm serve`).

Only argparse at import time: the server stack and torch load inside the handler, so
`adaspec --help` stays fast.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re

from adaspec.config import CUDAGRAPH_MODES
from adaspec.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'1073741824', '4GiB', '512MiB', '2GB' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use bytes or e.g. 512MiB, 4GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics)",
        description="Serve MODEL over an OpenAI-compatible HTTP API. SIGTERM drains: new requests get "
                    "503, running ones get --drain-timeout seconds, then the server exits 0.")
    p.add_argument("model", metavar="MODEL", help="HF model directory or embedded model name")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="speculative decoding configuration as a JSON object")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("ADASPEC_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $ADASPEC_API_KEY, "
                        "which keeps the key out of the process list)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) clients use; default: MODEL as given")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--skip-tokenizer-init", action="store_true", default=None,
                   help="load no tokenizer: only token-id prompts (completions' prompt as a list of ints)")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="explicit KV block count")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=None, metavar="BYTES",
                   help="KV cache size, e.g. 4GiB (ignored when --num-kv-blocks is given)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="FRACTION",
                   help="fraction of the GPU's memory for weights + KV cache, as vLLM's (the KV cache gets "
                        "what the weights leave); ignored on CPU and under --kv-cache-memory/--num-kv-blocks")
    p.add_argument("--enforce-eager", action="store_true", default=None)
    p.add_argument("--cudagraph-mode", default=None, choices=list(CUDAGRAPH_MODES),
                   help="which steps replay CUDA graphs: FULL (decode and verification steps, and steps with "
                        "prefill chunks, at tensor parallel size 1), FULL_DECODE_ONLY (prefill chunks run "
                        "eagerly), NONE (as --enforce-eager) (default: FULL)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each step before the previous one's tokens are read back, overlapping the "
                        "host's work with the GPU's (default: on with CUDA at tensor parallel size 1, with "
                        "speculation where its step has CUDA graphs: pipelined speculative steps; off under "
                        "tensor parallelism)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, metavar="N",
                   help="shard the model across N processes (GPUs cuda:0..N-1 of this host; default 1)")
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16", "half", "float"])
    p.add_argument("--load-format", default=None, choices=["auto", "safetensors", "dummy"])
    p.add_argument("--device", default=None, help="auto | cpu | cuda | cuda:N")
    p.add_argument("--attention-backend", default=None, choices=["auto", "reference", "varlen", "triton"])
    p.add_argument("--seed", type=int, default=None,
                   help="vLLM's engine seed: requests without a seed draw theirs from a generator seeded with it "
                        "(default 0)")
    p.add_argument("--generation-config", default=None, metavar="auto|vllm|DIR",
                   help="requests' sampling defaults (a field left out or null): auto, the model's "
                        "generation_config.json (its temperature, top_p, top_k), as vLLM; vllm, SamplingParams' "
                        "own; or a directory holding a generation_config.json (default auto)")
    p.add_argument("--max-queue", type=int, default=None,
                   help="waiting requests beyond which new ones get 503 + Retry-After (default: unlimited, "
                        "nothing is shed)")
    p.add_argument("--max-request-body-bytes", type=parse_bytes, default=None, metavar="BYTES",
                   help="larger request bodies get 413, e.g. 64MiB (default: 32MiB)")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="do not log each request's id, prompt lengths and sampling parameters (as vllm serve's)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="run the engine in a process of its own (as vLLM's engine core), so that HTTP and "
                        "streaming do not compete with it for the GIL (default: on when the engine runs on "
                        "CUDA at tensor parallel size 1, else a thread of the server)")
    p.add_argument("--api-server-count", "-asc", type=int, default=1, metavar="N",
                   help="HTTP server processes on the one engine (as vLLM's): at many streams one process "
                        "is the bound; more than 1 runs the engine in a process of its own (default 1)")
    p.add_argument("--api-detokenize", action=argparse.BooleanOptionalAction, default=None,
                   help="the API server processes decode the text of requests without stop strings, not the "
                        "engine (as vLLM's front end); needs the engine in a process of its own (default: on "
                        "with --api-server-count above 1)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let tool_choice "auto" (the default when a chat request has tools) read the calls the model '
                        "writes out of its text, with --tool-call-parser (as vllm serve's; named and \"required\" "
                        "calls need neither flag: structured outputs hold the text to the call's shape)")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "pythonic"],
                   help="the format the model writes its calls in: hermes, <tool_call>{\"name\": ..., "
                        "\"arguments\": {...}}</tool_call> (Hermes, Qwen2.5, Qwen3, and adaspec's own chat "
                        "template); llama3_json, a reply of {\"name\": ..., \"parameters\": {...}} objects "
                        "separated by ';', after <|python_tag|> or not (Llama 3.1 and 3.2); pythonic, a reply "
                        "that is a Python list of calls, [f(a=1), g()] (Llama 3.2 and 4)")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="the chat template to use instead of the model's: a Jinja file, or the template itself (as "
                        "vllm serve's), or the name of one of the model's named templates")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let a chat or /tokenize request bring its own chat_template (as vllm serve's; it runs in "
                        "a sandbox, but a template can still cost the server time)")
    p.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="put what a chat reply thinks between <think> and </think> in the message's \"reasoning\" "
                        "field (streamed as delta.reasoning), the rest in \"content\", and let structured outputs "
                        "wait for the end of the thinking (as vllm serve's; both names read the same tags, which must "
                        "be single tokens)")
    p.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help='keep the tools out of the chat template when tool_choice is "none" (default: the template '
                        "sees them, as vLLM's)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds running requests get after SIGTERM before being aborted (default 30)")
    p.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="do not log every HTTP request (as vllm serve's flag)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=_handler)


_ENGINE_FLAGS = ("tokenizer", "max_num_seqs", "max_model_len", "max_num_batched_tokens", "block_size",
                 "num_kv_blocks", "kv_cache_memory", "gpu_memory_utilization", "enforce_eager", "async_scheduling",
                 "cudagraph_mode", "dtype", "device",
                 "attention_backend", "seed", "speculative_config", "skip_tokenizer_init", "load_format",
                 "tensor_parallel_size", "generation_config", "reasoning_parser")


def _speculative_config(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--speculative-config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--speculative-config must be a JSON object like '{{\"method\": \"dspark\"}}', "
                          f"got a JSON {type(value).__name__}")
    return value


def engine_config_from_args(args: argparse.Namespace):
    from adaspec.config import EngineConfig

    # Only flags the user gave: EngineConfig's defaults stay the single source of defaults.
    kwargs = {k: getattr(args, k) for k in _ENGINE_FLAGS if getattr(args, k, None) is not None}
    if "speculative_config" in kwargs:
        kwargs["speculative_config"] = _speculative_config(kwargs["speculative_config"])
    return EngineConfig(model=args.model, **kwargs)


def settings_from_args(args: argparse.Namespace):
    from adaspec.serve.state import ServerSettings

    if args.max_queue is not None and args.max_queue < 1:
        raise ConfigError(f"--max-queue must be >= 1, got {args.max_queue}")
    if not args.drain_timeout >= 0:  # NaN too
        raise ConfigError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {args.port}")
    api_servers = getattr(args, "api_server_count", 1)
    if api_servers < 1:
        raise ConfigError(f"--api-server-count must be >= 1, got {api_servers}")
    engine_process = getattr(args, "engine_process", None)
    if api_servers > 1:
        if engine_process is False:
            raise ConfigError("--api-server-count above 1 needs the engine in a process of its own: drop "
                              "--no-engine-process")
        engine_process = True
    elif engine_process is None:
        engine_process = engine_process_default(args)
    api_detokenize = getattr(args, "api_detokenize", None)
    if api_detokenize is None:
        api_detokenize = api_servers > 1
    elif api_detokenize and not engine_process:
        raise ConfigError("--api-detokenize needs the engine in a process of its own (--engine-process): with "
                          "the engine in a thread it shares the API server's process anyway")
    extra = {}
    if args.max_request_body_bytes is not None:
        if args.max_request_body_bytes < 1:
            raise ConfigError(f"--max-request-body-bytes must be >= 1, got {args.max_request_body_bytes}")
        extra["max_request_body_bytes"] = args.max_request_body_bytes
    from adaspec.serve.tools import ToolSettings

    extra["tools"] = ToolSettings(getattr(args, "enable_auto_tool_choice", False), getattr(args, "tool_call_parser", None),
                                  getattr(args, "exclude_tools_when_tool_choice_none", False))
    extra["reasoning_parser"] = getattr(args, "reasoning_parser", None)
    extra["trust_request_chat_template"] = bool(getattr(args, "trust_request_chat_template", False))
    if getattr(args, "chat_template", None) is not None:
        extra["chat_template"] = read_chat_template(args.chat_template)
    return ServerSettings(served_model_names=list(args.served_model_name or [args.model]), model_path=args.model,
                          api_key=args.api_key, max_queue=args.max_queue, drain_timeout=args.drain_timeout,
                          disable_log_requests=args.disable_log_requests, engine_process=bool(engine_process),
                          api_server_count=api_servers, api_detokenize=bool(api_detokenize), **extra)


def read_chat_template(value: str) -> str:
    """--chat-template: a file's text, else the value itself when it reads as a template (or a name of
    one of the model's templates: a word); a path that does not open is an error, as vLLM's."""
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--chat-template {value!r}: cannot read it: {e}") from None
    if "{" in value or re.fullmatch(r"[\w-]+", value):
        return value
    raise ConfigError(f"--chat-template {value!r} looks like a file path, but there is no such file")


def engine_process_default(args: argparse.Namespace) -> bool:
    """--engine-process unless told: on for a CUDA engine at tensor parallel size 1. On the H200 the
    process served 1.37-1.48x the tokens of a thread at 64 and 256 streams and the same at 1
    (BENCHMARKS.md, run 14): the engine's host work no longer shares a GIL with HTTP and streaming.
    On CPU the forward itself needs the cores the HTTP side uses, and there it did not help; with
    tensor parallelism it is not measured."""
    if (getattr(args, "tensor_parallel_size", None) or 1) > 1:
        return False
    device = getattr(args, "device", None) or "auto"
    if device == "auto":
        import os

        device = os.environ.get("ADASPEC_DEVICE", "auto")  # as the engine resolves "auto"
    if device == "auto":
        # only here: parsing the flags stays free of torch. The server process then holds torch
        # (~1 s to import) without using CUDA itself; the engine process is spawned, not forked
        import torch

        return torch.cuda.is_available()
    return device.startswith("cuda")


def _handler(args: argparse.Namespace) -> int:
    config = engine_config_from_args(args)
    settings = settings_from_args(args)
    from adaspec.serve.server import run

    # picklable: with --engine-process the engine is built in a spawned process
    factory = functools.partial(build_engine, config)
    return run(factory, settings, args.host, args.port, args.log_level, not args.disable_uvicorn_access_log)


def build_engine(config):
    from adaspec.engine.llm_engine import LLMEngine

    return LLMEngine(config)
