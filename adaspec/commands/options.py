"""What every `adaspec` parser shares: the parser class, the help formatter, and the options
that mean the same thing in several commands, each defined once.

The top-level parser is an :class:`ArgumentParser`; argparse builds subparsers with the class
of their parent, so every subcommand, however deeply nested and whichever module registers
it, gets the same formatter and the same unknown-flag handling.
"""
from __future__ import annotations

import argparse
import copy
import re
import textwrap
from dataclasses import dataclass, fields

from adaspec.config import CUDAGRAPH_MODES

def at_least(low, convert=int):
    """argparse `type`: a number (`convert`: int or float) >= low; NaN and the like refused too."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'an integer' if convert is int else 'a number'}: {text!r}") from None
        if not value >= low:  # (NaN fails this too)
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {text}")
        return value

    parse.__name__ = convert.__name__
    return parse


_FLAG_ACTIONS = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction,
                 argparse._AppendConstAction, argparse._CountAction, argparse._HelpAction, argparse._VersionAction)
_DEFAULT_SUFFIX = re.compile(r"\s*\(default: [^()]*(\([^()]*\)[^()]*)*\)\s*$")
_CODE_SPAN = re.compile(r"``?([^`]+)``?")


def is_flag(action: argparse.Action) -> bool:
    return isinstance(action, _FLAG_ACTIONS) or action.nargs == 0


def format_default(value) -> str:
    """How a default reads on the command line: lists comma-separated, as the flags take them."""
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value)) if value else "none"
    return str(value)


def strip_default(help_text: str) -> str:
    """The help text without its trailing '(default: ...)' part."""
    return _DEFAULT_SUFFIX.sub("", help_text or "")


class HelpFormatter(argparse.HelpFormatter):
    """One formatter for every parser. Descriptions (module docstrings) are reflowed paragraph
    by paragraph, indented lines kept as written; every option shows its default (as
    ArgumentDefaultsHelpFormatter does, also for options declared without help) or says it
    is required; inline code spans (backticks, as written in docstrings) read as plain text."""

    def _fill_text(self, text, width, indent):
        paragraphs = []
        for para in re.split(r"\n\s*\n", _CODE_SPAN.sub(r"\1", text).strip("\n")):
            if any(line[:1].isspace() for line in para.splitlines()):
                paragraphs.append("\n".join(indent + line for line in para.splitlines()))
            else:
                paragraphs.append(textwrap.fill(" ".join(para.split()), width, initial_indent=indent,
                                                subsequent_indent=indent, break_on_hyphens=False))
        return "\n\n".join(paragraphs)

    def _split_lines(self, text, width):
        # "tiny-dspark" and "cuda:N"-like names must not break across lines
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _expand_help(self, action):
        return _CODE_SPAN.sub(r"\1", super()._expand_help(action))

    def _format_action(self, action):
        if not (action.help and action.help.strip()) and action.help != argparse.SUPPRESS:
            text = self._get_help_string(action).strip()
            if text:  # an option declared without help still shows its default
                action = copy.copy(action)
                action.help = text
        return super()._format_action(action)

    def _get_help_string(self, action):
        text = action.help or ""
        if text == argparse.SUPPRESS or is_flag(action) or not action.option_strings:
            return text
        if "%(default)" in text or re.search(r"\bdefault\b|\(required\)", text, re.IGNORECASE):
            return text  # the help already says what happens without the option
        if action.required:
            return f"{text} (required)".strip()
        if action.default is argparse.SUPPRESS:
            return text
        shown = "none" if action.default is None else format_default(action.default).replace("%", "%%")
        return f"{text} (default: {shown})".strip()


class _SubParsersAction(argparse._SubParsersAction):
    def add_parser(self, name, **kwargs):
        # a subcommand registered with only a one-line help still gets a description
        if kwargs.get("description") is None and kwargs.get("help"):
            kwargs["description"] = kwargs["help"][0].upper() + kwargs["help"][1:] + "."
        return super().add_parser(name, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        super().__call__(parser, namespace, values, option_string)
        # argparse hands a subcommand's unknown arguments back to the top-level parser, which
        # then prints its own usage; report them with the subcommand's usage instead
        attr = getattr(argparse, "_UNRECOGNIZED_ARGS_ATTR", "_unrecognized_args")
        extras = getattr(namespace, attr, None)
        if extras:
            self._name_parser_map[values[0]].error(f"unrecognized arguments: {' '.join(extras)}")


class ArgumentParser(argparse.ArgumentParser):
    def __init__(self, *args, formatter_class=None, **kwargs):
        # The stock classes a group module may ask for get ours (which keeps descriptions as
        # written, as RawDescriptionHelpFormatter does); a custom class is kept.
        if formatter_class in (None, argparse.HelpFormatter, argparse.RawDescriptionHelpFormatter,
                               argparse.ArgumentDefaultsHelpFormatter):
            formatter_class = HelpFormatter
        super().__init__(*args, formatter_class=formatter_class, **kwargs)
        self.register("action", "parsers", _SubParsersAction)


# -- options shared by several commands ------------------------------------------------------
@dataclass(frozen=True)
class Option:
    flags: tuple[str, ...]
    help: str
    default_text: str | None = None  # what a None default means, shown as "(default: ...)"
    kwargs: tuple = ()  # further add_argument keywords, as (name, value) pairs

    @property
    def dest(self) -> str:
        return self.flags[0].lstrip("-").replace("-", "_")

    def full_help(self, default=None) -> str:
        if default is None and self.default_text:
            return f"{self.help} (default: {self.default_text})"
        return self.help


def _engine_defaults() -> dict:
    from adaspec.config import EngineConfig

    return {f.name: f.default for f in fields(EngineConfig)}


def _bytes(text: str) -> int:
    from adaspec.serve.cli import parse_bytes  # argparse-only module: cheap to import

    return parse_bytes(text)


_bytes.__name__ = "size"


def _engine_options() -> dict[str, Option]:
    d = _engine_defaults()
    opts = [
        Option(("model",), "model directory (Hugging Face layout: config.json, safetensors weights, "
               "tokenizer.json) or an embedded model name (tiny)", kwargs=(("metavar", "MODEL"),)),
        Option(("--tokenizer",), "tokenizer directory (a Hugging Face tokenizer.json, as adaspec train tokenizer "
               "writes) or an embedded model name", "the model directory", (("metavar", "DIR"),)),
        Option(("--dtype",), "weight and activation dtype; auto is bfloat16 on CUDA, float32 on CPU (vLLM's half "
               "and float too)", d["dtype"], (("choices", ["auto", "float32", "bfloat16", "float16", "half", "float"]),)),
        Option(("--device",), "auto, cpu, cuda or cuda:N; auto picks CUDA when it is available", d["device"]),
        Option(("--load-format",), "how weights are loaded: auto or safetensors read the model directory; dummy "
               "makes random weights of the configured shape (config.json only), for timing", d["load_format"],
               (("choices", ["auto", "safetensors", "dummy"]),)),
        Option(("--max-model-len",), "longest sequence (prompt plus output) in tokens",
               "the model's max_position_embeddings", (("type", int), ("metavar", "N"))),
        Option(("--max-num-seqs",), "most requests running at once", str(d["max_num_seqs"]),
               (("type", int), ("metavar", "N"))),
        Option(("--max-num-batched-tokens",), "most tokens in one engine step", str(d["max_num_batched_tokens"]),
               (("type", int), ("metavar", "N"))),
        Option(("--block-size",), "tokens per KV cache block", str(d["block_size"]), (("type", int), ("metavar", "N"))),
        Option(("--num-kv-blocks",), "KV cache size in blocks, overriding --kv-cache-memory",
               "sized from --kv-cache-memory", (("type", int), ("metavar", "N"))),
        Option(("--kv-cache-memory",), "KV cache size, in bytes or e.g. 512MiB, 4GiB",
               "1 GiB on CPU, 30%% of free GPU memory on CUDA", (("type", _bytes), ("metavar", "BYTES"))),
        Option(("--attention-backend",), "attention kernel: triton (paged kernel reading the block tables; CUDA), "
               "varlen (gather + flash attention, CUDA with bfloat16 or float16) or reference (plain torch); auto "
               "picks triton on CUDA, else reference", d["attention_backend"],
               (("choices", ["auto", "reference", "varlen", "triton"]),)),
        Option(("--speculative-config",), "speculative decoding as a JSON object with vLLM's key names, e.g. "
               '{"method": "dspark", "num_speculative_tokens": 7}; the README lists every key',
               "no speculation", (("metavar", "JSON"),)),
        Option(("--tensor-parallel-size", "-tp"), "processes (GPUs of one host: cuda:0..N-1; or CPU processes) the "
               "model is sharded across", str(d["tensor_parallel_size"]), (("type", int), ("metavar", "N"))),
        Option(("--enforce-eager",), "run the model eagerly, without CUDA graphs (graphs are captured on CUDA with "
               "the triton attention backend)", kwargs=(("action", "store_true"),)),
        Option(("--gpu-memory-utilization",), "fraction of the GPU's memory for weights + KV cache, as vLLM's "
               "(ignored on CPU and under --kv-cache-memory / --num-kv-blocks)", "unset: --kv-cache-memory's",
               (("type", float), ("metavar", "FRACTION"))),
        Option(("--generation-config",), "requests' sampling defaults: auto, the model's generation_config.json "
               "(its temperature, top_p, top_k, max_new_tokens), as vLLM; vllm, SamplingParams' own; or a "
               "directory holding a generation_config.json", d["generation_config"], (("metavar", "auto|vllm|DIR"),)),
        Option(("--cudagraph-mode",), "which steps replay CUDA graphs (vLLM's compilation_config cudagraph_mode "
               "values): FULL (decode and verification steps, and steps with prefill chunks at tensor "
               "parallel size 1), FULL_DECODE_ONLY (prefill chunks run eagerly), NONE (as --enforce-eager)",
               "FULL",
               (("choices", list(CUDAGRAPH_MODES)),)),
        Option(("--async-scheduling",), "launch each step before the previous one's tokens are read back, "
               "overlapping the host's work with the GPU's (with speculation: pipelined speculative steps)",
               "on with CUDA at tensor parallel size 1 (with speculation where its step has CUDA graphs), off "
               "under tensor parallelism", (("action", argparse.BooleanOptionalAction),)),
        Option(("--seed",), "vLLM's engine seed: the seeds of requests that bring none are drawn from a generator "
               "seeded with it, so a run repeats (a request's own seed makes it repeatable whatever else runs)",
               str(d["seed"]), (("type", int), ("metavar", "N"))),
    ]
    return {o.dest: o for o in opts}


ENGINE_OPTIONS = _engine_options()
# options that mean the same thing in every command that has them
SHARED_OPTIONS = {
    "device": ENGINE_OPTIONS["device"],
    "target": Option(("--target",), "target model directory or embedded name, e.g. tiny"),
    "drafter": Option(("--drafter",), "DSpark drafter directory or embedded name, e.g. tiny-dspark",
                      "the target's own drafter, tiny-dspark for tiny"),
}


# options that mean the same thing in every `adaspec train` subcommand that has them
TRAIN_OPTIONS = {
    "tokenizer": ENGINE_OPTIONS["tokenizer"],
    "corpus": Option(("--corpus",), "corpus directory, as adaspec train corpus writes it"),
    "save_dtype": Option(("--save-dtype",), "dtype of the saved weights"),
    "resume": Option(("--resume",), "continue from OUT/checkpoint.pt when it exists"),
}


def add_option(parser, option: Option, default=None, default_text: str | None = None, **overrides):
    """Add a shared option; `default_text` says what a None default means in this command."""
    kw = dict(option.kwargs)
    kw.update(overrides)
    if option.flags[0].startswith("-"):
        kw["default"] = default
    shown = None if kw.get("required") else default_text or option.default_text
    text = f"{option.help} (default: {shown})" if default is None and shown else option.help
    return parser.add_argument(*option.flags, help=text, **kw)


# the engine flags of the offline commands (generate, profile), by EngineConfig field name
ENGINE_ARGS = ("tokenizer", "dtype", "load_format", "device", "max_model_len", "max_num_seqs",
               "max_num_batched_tokens", "block_size", "num_kv_blocks", "kv_cache_memory", "attention_backend",
               "speculative_config", "tensor_parallel_size", "async_scheduling", "cudagraph_mode", "enforce_eager",
               "gpu_memory_utilization", "generation_config")


def add_engine_args(parser, **default_texts: str) -> None:
    """The engine flags (vLLM's names). Defaults stay None: EngineConfig's are the only ones,
    and each help says what it is; `default_texts` (by dest) restate one for this command."""
    for name in ENGINE_ARGS:
        add_option(parser, ENGINE_OPTIONS[name], default_text=default_texts.get(name))


def engine_kwargs(args) -> dict:
    """EngineConfig keywords for the engine flags the user gave."""
    return {n: getattr(args, n) for n in ENGINE_ARGS if getattr(args, n, None) is not None}


def _parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases map to the same parser
                yield from _parsers(sub)


def all_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """`parser` and every subparser below it."""
    return list(_parsers(parser))


def apply_shared_help(parser: argparse.ArgumentParser, options: dict[str, Option]) -> None:
    """Give the actions of `parser` (and its subparsers) whose dest is in `options` the shared
    help text. For parsers declared in modules that do not build their options from here."""
    for p in all_parsers(parser):
        for action in p._actions:
            opt = options.get(action.dest)
            if opt is None or bool(action.option_strings) != opt.flags[0].startswith("-"):
                continue
            action.help = opt.full_help(action.default if not action.required else "required")
            metavar = dict(opt.kwargs).get("metavar")
            if metavar and action.option_strings:
                action.metavar = metavar
