"""Turn a validated request body into (prompt token ids, SamplingParams), or a 400.

The routes run this before the request reaches the engine (on the event loop for a small body,
in a worker thread for a large one: app.INLINE_BODY_BYTES), so length errors are answered first
and the chat default ``max_tokens`` (the rest of the context) can be computed. A text that cannot
fit the context whatever its tokenization (``ServeState.prompt_bound``) is refused before
it is tokenized.
"""
from __future__ import annotations

from dataclasses import dataclass

from adaspec.errors import InvalidRequestError
from adaspec.models.tokenizer import check_template_kwargs
from adaspec.sampling_params import (UNSUPPORTED_UNLESS, SamplingParams, StructuredOutputsParams, is_neutral,
                                     token_id, truncated_prompt)
from adaspec.serve.errors import APIError
from adaspec.serve.protocol import ChatCompletionRequest, CompletionRequest
from adaspec.serve.reasoning import prompt_opens_thinking
from adaspec.serve.state import ServeState
from adaspec.serve.tools import ToolPlan, plan_tools, template_messages


MAX_BATCH = 256  # choices (prompts x n) in one request; larger batches belong in several requests
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions; null means this too

# Parameters adaspec does not implement, with the values that ask for nothing: any other value
# is a 400 (silently ignoring it would return something other than what was asked for). The
# SamplingParams fields share the offline API's table (sampling_params.UNSUPPORTED_UNLESS).
_NEUTRAL: dict[str, tuple] = {
    **{k: UNSUPPORTED_UNLESS[k] for k in (
        "spaces_between_special_tokens",)},
    "use_beam_search": (False,), "length_penalty": (1.0,), "return_tokens_as_token_ids": (False,),
    # structured outputs: llguidance is the one backend (vLLM's "guidance"); disable_any_whitespace
    # in structured_outputs is how to narrow JSON's whitespace
    "guided_whitespace_pattern": (), "guided_decoding_backend": ("auto", "guidance"), "structural_tag": (),
}


def _bad(msg: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, msg, param, code)


def _reject_unsupported(req, table: dict[str, tuple]) -> None:
    for name, neutral in table.items():
        value = getattr(req, name)
        if not is_neutral(value, neutral):
            only = " or ".join(repr(n) for n in neutral) if neutral else "null"
            raise _bad(f"{name} is not supported by adaspec (only {only}), got {value!r}.", name,
                       "unsupported_parameter")
    if req.stream_options is not None and not req.stream:
        raise _bad("stream_options is only allowed when stream is true.", "stream_options")


def _tok(fn, param: str, what: str):
    """Run a tokenizer call; whatever it rejects (lone surrogates, a chat template that raises on
    the message order, an id it cannot decode) is the client's input, so a 400, not a 500."""
    try:
        return fn()
    except InvalidRequestError:  # already says what is wrong (e.g. the template's raise_exception)
        raise
    except Exception as e:  # noqa: BLE001
        raise _bad(f"Cannot {what}: {type(e).__name__}: {e}", param) from None


def _need_tokenizer(state: ServeState, what: str, param: str) -> None:
    if state.tokenizer is None:
        raise _bad(f"This server runs with --skip-tokenizer-init: it cannot {what}. "
                   "Send the completions prompt as a list of token ids.", param)


def detokenize(state: ServeState, ids: list[int]) -> str:
    _need_tokenizer(state, "decode tokens", "tokens")
    _check_ids(state, ids, "tokens")
    return _tok(lambda: state.tokenizer.decode(ids), "tokens", "decode these tokens")


def _check_ids(state: ServeState, ids: list[int], param: str) -> None:
    vocab = getattr(state.tokenizer, "vocab_size", None)
    for t in ids:
        if t < 0 or (isinstance(vocab, int) and t >= vocab):
            raise _bad(f"Token id {t} is out of the vocabulary.", param)


def _check_length(state: ServeState, n_prompt: int, max_tokens: int | None, param: str,
                  max_tokens_param: str = "max_tokens") -> None:
    limit = state.max_model_len
    if n_prompt == 0:
        raise _bad("The prompt is empty.", param)
    if n_prompt >= limit:
        raise _bad(f"This model's maximum context length is {limit} tokens, and your prompt has "
                   f"{n_prompt} tokens, leaving no room to generate. Shorten the prompt.",
                   param, "context_length_exceeded")
    if max_tokens is not None and n_prompt + max_tokens > limit:
        raise _bad(f"This model's maximum context length is {limit} tokens. However, you requested "
                   f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the "
                   f"completion). Reduce the prompt or {max_tokens_param}.", max_tokens_param, "context_length_exceeded")


def _check_text_length(state: ServeState, text: str, param: str, truncated: bool = False) -> None:
    """Refuse a text no tokenization of which fits, before tokenizing it; not one that
    truncate_prompt_tokens will cut (vLLM truncates, then checks the length; the body's size cap
    still bounds the text)."""
    bound = state.prompt_bound
    if not truncated and bound is not None and bound.cannot_fit(text, state.max_model_len):
        raise _bad(f"This model's maximum context length is {state.max_model_len} tokens, and your prompt has "
                   f"{len(text)} characters: more than any tokenization of it could fit. Shorten the prompt.",
                   param, "context_length_exceeded")


LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range of a logit bias; vLLM clamps a larger one to it


def _logit_bias(state: ServeState, bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as strings) -> {token id: bias clamped to +-100}."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        token = token_id(key)
        if token is None:
            raise _bad(f"logit_bias keys must be token ids, got {key!r}.", "logit_bias")
        _check_ids(state, [token], "logit_bias")
        out[token] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, value)) if value == value else value
    return out


def _params(req, max_tokens: int | None, logprobs: int | None, state: ServeState,
            structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
    """structured_outputs: a constraint of the request's own making (a tool call's shape), else
    whichever of its fields asked for one."""
    if req.stop_token_ids:
        _check_ids(state, req.stop_token_ids, "stop_token_ids")
    if req.allowed_token_ids:
        _check_ids(state, req.allowed_token_ids, "allowed_token_ids")
    given = state.sampling_defaults  # the model's recommended values, else SamplingParams' defaults

    def default(value, name: str, own):
        return value if value is not None else given.get(name, own)

    return SamplingParams(
        n=1 if req.n is None else req.n,
        temperature=default(req.temperature, "temperature", 1.0),
        top_p=default(req.top_p, "top_p", 1.0),
        top_k=default(req.top_k, "top_k", 0),
        min_p=default(req.min_p, "min_p", 0.0),
        repetition_penalty=default(req.repetition_penalty, "repetition_penalty", 1.0),
        presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
        frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
        logit_bias=_logit_bias(state, req.logit_bias),
        min_tokens=0 if req.min_tokens is None else req.min_tokens,
        allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words,
        prompt_logprobs=req.prompt_logprobs,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        seed=req.seed,
        max_tokens=max_tokens,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=bool(req.ignore_eos),
        logprobs=logprobs,
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        skip_special_tokens=req.skip_special_tokens is not False,
        structured_outputs=structured_outputs or structured_outputs_of(req),
    )


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_fields(req) -> list[str]:
    """The request's fields that ask for structured outputs (response_format "text" asks for none)."""
    fields = [name for name in ("structured_outputs", *_GUIDED) if getattr(req, name) is not None]
    fmt = req.response_format
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        fields.append("response_format")
    return fields


def structured_outputs_of(req) -> StructuredOutputsParams | None:
    """What the output must follow, from whichever field asked: vLLM's structured_outputs object,
    its older guided_json / guided_regex / guided_choice / guided_grammar, or OpenAI's
    response_format (json_object, or json_schema with its schema). At most one of them."""
    asked: dict[str, StructuredOutputsParams] = {}
    so = req.structured_outputs
    if so is not None:
        if not isinstance(so, dict):
            raise _bad(f"structured_outputs must be an object, got {type(so).__name__}.", "structured_outputs")
        asked["structured_outputs"] = StructuredOutputsParams.from_dict(so)
    for name, kind in _GUIDED.items():
        v = getattr(req, name)
        if v is not None:
            asked[name] = _with_param(lambda: StructuredOutputsParams(**{kind: v}), name)
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            asked["response_format"] = StructuredOutputsParams(json_object=True)
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict):
                raise _bad("response_format of type json_schema needs a json_schema object ({\"name\": ..., "
                           "\"schema\": {...}}).", "response_format")
            schema = spec.get("schema")
            if schema is None:  # OpenAI's schema is optional: then any JSON object
                asked["response_format"] = StructuredOutputsParams(json_object=True)
            else:
                asked["response_format"] = _with_param(lambda: StructuredOutputsParams(json=schema), "response_format")
        elif kind != "text":
            raise _bad(f"response_format type must be one of 'text', 'json_object' and 'json_schema', got {kind!r}.",
                       "response_format")
    if len(asked) > 1:
        raise _bad(f"Ask for structured outputs one way only; this request sets {sorted(asked)}.", sorted(asked)[0])
    return next(iter(asked.values()), None)


def _with_param(make, param: str):
    """Build a StructuredOutputsParams, its error named after the request field that asked."""
    try:
        return make()
    except InvalidRequestError as e:
        raise InvalidRequestError(f"{param}: {e}", param=param) from None


def completion_prompt_ids(state: ServeState, prompt, add_special_tokens: bool | None = None,
                          truncated: bool = False) -> list[int]:
    """One prompt (a string or token ids) -> token ids. A text prompt gets the tokenizer's special
    tokens (a Llama tokenizer's BOS) unless add_special_tokens is False, as vLLM's completions.
    truncated: truncate_prompt_tokens will cut the ids (_check_text_length)."""
    if isinstance(prompt, str):
        _need_tokenizer(state, "tokenize a text prompt", "prompt")
        _check_text_length(state, prompt, "prompt", truncated)
        special = add_special_tokens is not False
        return list(_tok(lambda: state.tokenizer.encode(prompt, add_special_tokens=special), "prompt",
                         "tokenize the prompt"))
    ids = list(prompt)
    _check_ids(state, ids, "prompt")
    return ids


def completion_prompts(state: ServeState, prompt, add_special_tokens: bool | None = None,
                       truncated: bool = False) -> list[list[int]]:
    """The ``prompt`` field -> one token-id list per prompt (a list of strings or of id lists is a batch)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) > MAX_BATCH:
            raise _bad(f"At most {MAX_BATCH} prompts per request, got {len(prompt)}.", "prompt")
        return [completion_prompt_ids(state, p, add_special_tokens, truncated) for p in prompt]
    return [completion_prompt_ids(state, prompt, add_special_tokens, truncated)]


def _check_choices(num_prompts: int, n: int) -> None:
    """Every sample of every prompt is an engine request: a request may ask for MAX_BATCH in all."""
    if num_prompts * n > MAX_BATCH:
        raise _bad(f"At most {MAX_BATCH} choices per request (prompts x n), got {num_prompts} x {n}.", "n")


@dataclass
class Echo:
    """A completions request's echo: each prompt's text before its choices' text (a text prompt as
    sent, token ids decoded), and, with logprobs, its tokens' logprobs before theirs (the first
    token's null, as OpenAI). max_tokens 0 asks for the prompt alone (vLLM's echo without
    generation: the engine makes one token, which is not returned)."""

    texts: list[str]
    without_generation: bool


def prepare_completion(state: ServeState, req: CompletionRequest
                       ) -> tuple[list[list[int]], SamplingParams, Echo | None]:
    _reject_unsupported(req, _NEUTRAL)
    if req.best_of not in (None, 1):
        raise _bad("best_of is not supported by adaspec (only 1); n gives several samples of a prompt.", "best_of")
    if req.suffix:
        raise _bad("suffix is not supported by adaspec.", "suffix", "unsupported_parameter")
    echo = _flag(req.echo, "echo")
    max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    without_generation = bool(echo) and max_tokens == 0
    params = _params(req, 1 if without_generation else max_tokens, req.logprobs, state)
    if echo and params.logprobs is not None and params.prompt_logprobs is None:
        params.prompt_logprobs = params.logprobs  # the prompt's logprobs come before the completion's (vLLM)
    batch = req.prompt if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int) else [0]
    if len(batch) <= MAX_BATCH:  # before the prompts are tokenized (a longer batch is refused there)
        _check_choices(len(batch), params.n)
    prompts = [truncated_prompt(ids, params, state.max_model_len)
               for ids in completion_prompts(state, req.prompt, _flag(req.add_special_tokens, "add_special_tokens"),
                                             params.truncate_prompt_tokens is not None)]
    for ids in prompts:
        _check_length(state, len(ids), params.max_tokens, "prompt")
    if not echo:
        return prompts, params, None
    given = req.prompt if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int) \
        else [req.prompt]
    if params.truncate_prompt_tokens is not None:  # the tokens kept are the prompt echoed
        given = prompts
    texts = [p if isinstance(p, str) else _tok(lambda p=p: state.tokenizer.decode(list(p)), "prompt", "decode the prompt")
             if state.tokenizer is not None else "" for p in given]
    return prompts, params, Echo(texts, without_generation)


def _flag(value, name: str) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise _bad(f"{name} must be true or false, got {value!r}.", name)
    return value


def chat_request_ids(state: ServeState, req, tools: list[dict] | None) -> list[int]:
    return chat_request_prompt(state, req, tools)[0]


def chat_request_prompt(state: ServeState, req, tools: list[dict] | None,
                        truncated: bool = False) -> tuple[list[int], str]:
    """A chat or /tokenize request's messages through the chat template -> (token ids, text). The
    template writes the special tokens, so none are added unless add_special_tokens is true (vLLM's
    chat default). The template sees add_generation_prompt (default true, but false under
    continue_final_message), chat_template_kwargs (vLLM's, e.g. Qwen3's enable_thinking), the tools
    (tools.ToolPlan.template_tools; a /tokenize request's own) and documents."""
    _need_tokenizer(state, "apply a chat template", "messages")
    check_template_kwargs(req.chat_template_kwargs)  # an object of keywords, before it is read as one
    add = _flag(req.add_generation_prompt, "add_generation_prompt")
    cont = _flag(req.continue_final_message, "continue_final_message")
    text = _render_chat(state, req, tools, add is not False and not (cont and add is None))
    _check_text_length(state, text, "messages", truncated)
    special = bool(_flag(req.add_special_tokens, "add_special_tokens"))
    return list(_tok(lambda: state.tokenizer.encode(text, add_special_tokens=special), "messages",
                     "tokenize the messages")), text


def _render_chat(state: ServeState, req, tools: list[dict] | None, add_generation_prompt: bool) -> str:
    kwargs = dict(req.chat_template_kwargs or {})
    if tools is not None:
        kwargs["tools"] = tools
    if req.documents is not None:
        kwargs["documents"] = _documents(req.documents)
    if req.continue_final_message:
        kwargs["continue_final_message"] = True
    template = _request_template(state, req.chat_template)
    if template is not None:
        kwargs["chat_template"] = template
    msgs = template_messages(req.messages)
    return _tok(lambda: state.tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, **kwargs),
                "messages", "apply the chat template")


def _request_template(state: ServeState, asked) -> str | None:
    """The template: the request's own (only with --trust-request-chat-template, as vLLM), else
    --chat-template's, else None (the model's)."""
    if asked is None:
        return state.settings.chat_template
    if not state.settings.trust_request_chat_template:
        raise _bad("A chat template in a request runs only on a server started with --trust-request-chat-template; "
                   "this one uses its own.", "chat_template", "unsupported_parameter")
    if not isinstance(asked, str) or not asked:
        raise _bad(f"chat_template must be a template (a string), got {asked!r}.", "chat_template")
    return asked


def _documents(documents) -> list[dict]:
    """vLLM's documents, for a retrieval template: objects of strings (e.g. {"title", "text"})."""
    if not isinstance(documents, list) or not all(
            isinstance(d, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in d.items())
            for d in documents):
        raise _bad("documents must be a list of objects of strings, e.g. [{\"title\": ..., \"text\": ...}].",
                   "documents")
    return documents


@dataclass(frozen=True)
class ChatReading:
    """How a chat choice's text is read: its tool calls (tools.ToolPlan), and with
    --reasoning-parser whether it starts inside the thinking (reasoning.prompt_opens_thinking;
    None: no reasoning parser)."""

    tools: ToolPlan
    thinking: bool | None = None
    echo: str | None = None  # vLLM's chat echo: the assistant message the reply continues, before it


def prepare_chat(state: ServeState, req: ChatCompletionRequest) -> tuple[list[int], SamplingParams, ChatReading]:
    _reject_unsupported(req, _NEUTRAL)
    if req.stream and req.prompt_logprobs is not None:  # (vLLM refuses it too: no chunk carries them)
        raise _bad("prompt_logprobs is not available when stream is true.", "prompt_logprobs")
    if req.top_logprobs is not None and not req.logprobs:
        raise _bad("top_logprobs requires logprobs to be true.", "top_logprobs")
    tools = plan_tools(req, state.settings.tools, structured_fields(req))
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    try:
        params = _params(req, max_tokens, logprobs, state, tools.structured_outputs)
    except InvalidRequestError as e:
        if e.param == "logprobs":  # chat's name for the count
            raise InvalidRequestError(str(e).replace("logprobs", "top_logprobs", 1), "top_logprobs") from None
        if e.param == "max_tokens" and req.max_completion_tokens is not None:
            raise InvalidRequestError(str(e).replace("max_tokens", "max_completion_tokens", 1),
                                      "max_completion_tokens") from None
        raise
    reasoning = state.settings.reasoning_parser is not None
    if tools.mode == "auto" and "skip_special_tokens" not in req.model_fields_set:
        # a tokenizer may hold the call tags as special tokens: the parser must see them (vLLM's hermes
        # parser turns them on so)
        params.skip_special_tokens = False
    _check_choices(1, params.n)
    ids, text = chat_request_prompt(state, req, tools.template_tools, params.truncate_prompt_tokens is not None)
    ids = truncated_prompt(ids, params, state.max_model_len)
    _check_length(state, len(ids), params.max_tokens, "messages",
                  "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
    if params.max_tokens is None:  # vLLM's default for chat: the rest of the context window
        params.max_tokens = state.max_model_len - len(ids)
    return ids, params, ChatReading(tools, _starts_thinking(state, req, tools, text, params) if reasoning else None,
                                    _echo(req))


def _echo(req) -> str | None:
    """vLLM's chat echo: the last message's content before the reply's, where the reply continues it
    (no generation prompt added, and it is the assistant's: adaspec's replies are the assistant's)."""
    if not _flag(req.echo, "echo"):
        return None
    last = req.messages[-1]
    continues = req.add_generation_prompt is False or (req.continue_final_message and req.add_generation_prompt is None)
    return last.text() if continues and last.role == "assistant" and last.text() else None


def _starts_thinking(state: ServeState, req, tools: ToolPlan, text: str, params: SamplingParams) -> bool:
    """Whether the reply starts inside <think>: what the template appends as the generation
    prompt leaves one open (the rest of the prompt may quote tags in its messages). A constrained
    reply (a tool call, response_format, a regex) thinks first where the engine's grammars wait for
    the end of the thinking (its reasoning_parser, which `adaspec serve --reasoning-parser` sets);
    held to the constraint from its first token, it answers at once, in content."""
    if (params.structured_outputs is not None and not state.grammar_waits_for_thinking) or "<think>" not in text:
        return False
    if _flag(req.add_generation_prompt, "add_generation_prompt") is False or req.continue_final_message:
        return prompt_opens_thinking(text)  # the reply continues the prompt's last message
    before = _render_chat(state, req, tools.template_tools, add_generation_prompt=False)
    return prompt_opens_thinking(text[len(before):] if text.startswith(before) else text)
