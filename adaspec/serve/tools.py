"""Tool calling in chat requests: what ``tools`` and ``tool_choice`` ask of a generation (as vLLM's).

- ``"none"`` (the default without tools): text only. The tools still reach the chat template
  unless the server runs with ``--exclude-tools-when-tool-choice-none``.
- a named function, ``{"type": "function", "function": {"name": N}}``: the output is held to N's
  ``parameters`` schema (structured outputs); the message carries one call to N.
- ``"required"``: the output is held to a JSON array of one or more ``{"name": one of the tools,
  "parameters": its schema}`` (one at most when ``parallel_tool_calls`` is false); each element is a
  call. With an empty ``tools`` list it is ``"none"``, as OpenAI, and so is "auto".
- ``"auto"`` (the default with tools): free text, from which the server's ``--tool-call-parser``
  reads the calls; it needs ``--enable-auto-tool-choice``, as vLLM.

serve/tool_parsers.py reads the calls back out of the text.
"""
from __future__ import annotations

from dataclasses import dataclass

from adaspec.models.tokenizer import message_for_template
from adaspec.sampling_params import StructuredOutputsParams
from adaspec.serve.errors import APIError
from adaspec.serve.tool_parsers import TOOL_CALL_PARSERS, NamedCall, JsonCalls, ToolCallParser

_ANY_OBJECT = {"type": "object"}  # a function that declares no parameters takes an object all the same


@dataclass(frozen=True)
class ToolSettings:
    """The server's tool-calling flags (vllm serve's)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False

    def __post_init__(self) -> None:
        from adaspec.errors import ConfigError

        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"--tool-call-parser must be one of {sorted(TOOL_CALL_PARSERS)}, "
                              f"got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser (e.g. hermes): it names the "
                              "format the model writes its calls in")


@dataclass(frozen=True)
class ToolPlan:
    """What one chat request's tools ask: ``mode`` is "none", "auto", "required" or "named"."""

    mode: str
    template_tools: list[dict] | None = None  # what the chat template sees as ``tools``
    name: str | None = None  # the named function
    structured_outputs: StructuredOutputsParams | None = None  # holds the output to the call's shape
    max_calls: int | None = None  # parallel_tool_calls false: 1
    parser: str | None = None  # "auto": the server's --tool-call-parser

    @property
    def reads_calls(self) -> bool:
        return self.mode != "none"

    def output_parser(self) -> ToolCallParser:
        """A fresh parser for one choice's text."""
        if self.mode == "named":
            return NamedCall(self.name)
        if self.mode == "required":
            return JsonCalls()
        return TOOL_CALL_PARSERS[self.parser](max_calls=self.max_calls)

    def finish_reason(self, finish: str | None, called: bool) -> str | None:
        """OpenAI's "tool_calls" when the model stopped after calling; a named call keeps the
        engine's reason (as vLLM and OpenAI: the caller forced it)."""
        if called and finish == "stop" and self.mode in ("auto", "required"):
            return "tool_calls"
        return finish


NO_TOOLS = ToolPlan("none")


def _bad(msg: str, param: str) -> APIError:
    return APIError(400, msg, param, "invalid_value")


def plan_tools(req, settings: ToolSettings, asked: list[str] = ()) -> ToolPlan:
    """A chat request's tools and tool_choice -> its ToolPlan, or a 400 naming the field. asked:
    the request's fields that ask for structured outputs themselves (prepare.structured_fields)."""
    tools = req.tools
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and tools is None:
        raise _bad("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice in ("auto", "required") and not tools:
        choice = "none"  # an empty tools list: nothing to call (OpenAI's "required" so)
    by_name = {}
    for i, tool in enumerate(tools or []):
        name = tool.function.name
        if name in by_name:
            raise _bad(f"tools has more than one function named {name!r}: a call names the function it calls.",
                       f"tools.{i}.function.name")
        by_name[name] = tool
    template_tools = tools_for_template(tools)
    max_calls = 1 if req.parallel_tool_calls is False else None
    if choice == "none":
        return ToolPlan("none", None if settings.exclude_tools_when_tool_choice_none else template_tools)
    if choice == "auto":
        if not settings.enable_auto_tool_choice:
            raise _bad('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                       '(this server reads no calls out of free text); name a function in tool_choice, or ask '
                       'for "required" or "none".', "tool_choice")
        return ToolPlan("auto", template_tools, max_calls=max_calls, parser=settings.tool_call_parser)
    if asked:  # both would constrain the same text
        raise _bad(f"tool_choice {_choice_text(choice)} holds the output to the tools' schemas; it cannot also "
                   f"follow {asked[0]}.", asked[0])
    if choice == "required":
        schema = _required_schema(by_name)
        if max_calls == 1:
            schema["maxItems"] = 1
        return ToolPlan("required", template_tools, structured_outputs=_structured(schema, "tools"), max_calls=max_calls)
    name = choice.function.name
    if name not in by_name:
        raise _bad(f"tool_choice names the function {name!r}, which is not among the tools "
                   f"({', '.join(map(repr, by_name))}).", "tool_choice")
    i = list(by_name).index(name)
    schema = by_name[name].function.parameters or _ANY_OBJECT
    return ToolPlan("named", template_tools, name=name,
                    structured_outputs=_structured(schema, f"tools.{i}.function.parameters"))


def tools_for_template(tools) -> list[dict] | None:
    """The request's tools as the chat template sees them: the fields as the client sent them."""
    return [t.model_dump(exclude_unset=True) for t in tools] if tools else None


def _choice_text(choice) -> str:
    return repr(choice) if isinstance(choice, str) else f"(the function {choice.function.name!r})"


def _required_schema(by_name: dict) -> dict:
    """An array of one or more calls, each {"name": a tool's, "parameters": its schema}. The tools'
    definitions ($defs, or draft-7's definitions) move to the array's root, where their
    "#/$defs/..." references point (Pydantic-made tools use them); one name defined two ways is a
    400, since the one root holds them all."""
    calls, roots = [], {}
    for i, (name, tool) in enumerate(by_name.items()):
        params = dict(tool.function.parameters or _ANY_OBJECT)
        for key in ("$defs", "definitions"):
            defs = params.pop(key, None) or {}
            if not isinstance(defs, dict):
                raise _bad(f"{key} must be an object of schemas.", f"tools.{i}.function.parameters.{key}")
            root = roots.setdefault(key, {})
            for d, sub in defs.items():
                if root.setdefault(d, sub) != sub:
                    raise _bad(f"Two tools define {key}/{d} differently; with tool_choice \"required\" every tool's "
                               "definitions share one schema.", f"tools.{i}.function.parameters.{key}")
        calls.append(_call_schema(name, params))
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **{k: v for k, v in roots.items() if v}}


def _call_schema(name: str, parameters: dict | None) -> dict:
    return {"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                             "parameters": parameters or _ANY_OBJECT},
            "required": ["name", "parameters"], "additionalProperties": False}


# A call's JSON is written as json.dumps writes it (and as the chat templates write earlier calls,
# with tojson): ", " and ": " between items, no other whitespace. Free whitespace let a weak model
# pad the arguments with newlines until max_tokens (the tiny model did, at temperature 0).
CALL_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _structured(schema: dict, param: str) -> StructuredOutputsParams:
    """The constraint (in CALL_JSON_STYLE unless the schema's own x-guidance says otherwise), its
    schema checked here so that an error names the tool (the engine compiles it against the
    tokenizer later)."""
    import llguidance

    from adaspec.errors import InvalidRequestError
    from adaspec.sample.structured_outputs import grammar_text

    own = schema.get("x-guidance")
    schema = {**schema, "x-guidance": {**CALL_JSON_STYLE, **(own if isinstance(own, dict) else {})}}
    try:
        params = StructuredOutputsParams(json=schema)
        error = llguidance.LLMatcher.validate_grammar(grammar_text(params))
    except (InvalidRequestError, ValueError, TypeError) as e:  # what llguidance raises on a schema it cannot read
        error = str(e)
    if error:
        raise _bad(f"{param}: the schema does not compile: {error.strip()}", param)
    return params


def template_messages(messages) -> list[dict]:
    """The request's chat messages as the template reads them (models.tokenizer.message_for_template)."""
    return [message_for_template(m.model_dump(exclude_none=True), f"messages.{i}") for i, m in enumerate(messages)]
