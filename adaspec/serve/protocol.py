"""Request bodies of the OpenAI-compatible API, as pydantic models.

Strict types (``"5"`` is not an int, ``1`` is not a bool) because OpenAI rejects them too and a
silently coerced parameter is worse than a clear 400. Unknown fields are ignored, as in vLLM,
so clients that send newer OpenAI fields keep working.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage so far in every chunk


class _SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # absent: the (first) served model, as vLLM does
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM)
    seed: int | None = Field(None, description=(
        "Sampling seed (signed 64-bit). The same seed gives the same text without speculation whatever the "
        "batch, with fixed k as long as every step verifies all k drafts; with adaptive verification only for "
        "the same arm, cost tables and batch composition (the README's 'Seeds: what is reproducible')."))
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    # null is accepted wherever a default exists: some clients send every field, unset ones as null
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    ignore_eos: bool | None = False  # extension (vLLM)
    include_stop_str_in_output: bool | None = False  # extension (vLLM)
    skip_special_tokens: bool | None = True  # extension (vLLM)
    # the logits rules (sample/logits_rules.py; SamplingParams validates them)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string) -> bias, clamped to [-100, 100] as vLLM
    repetition_penalty: float | None = None  # extension (vLLM)
    min_tokens: int | None = None  # extension (vLLM)
    min_p: float | None = None  # extension (vLLM)
    allowed_token_ids: list[int] | None = None  # extension (vLLM)
    bad_words: list[str] | None = None  # extension (vLLM)
    # structured outputs (sample/structured_outputs.py; prepare.structured_outputs_of): OpenAI's
    # response_format, vLLM's structured_outputs object and its older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # vLLM's options of those: refused unless neutral (prepare._NEUTRAL), never silently ignored
    guided_whitespace_pattern: Any = None
    guided_decoding_backend: Any = None
    structural_tag: Any = None
    # vLLM sampling extensions adaspec does not implement: declared so that a non-neutral value
    # is a 400 (prepare.NEUTRAL) instead of being ignored like an unknown field.
    use_beam_search: Any = None
    length_penalty: Any = None
    prompt_logprobs: int | None = None  # extension (vLLM): the choices' "prompt_logprobs"
    truncate_prompt_tokens: int | None = None  # extension (vLLM): keep the prompt's last k tokens (-1: the context)
    add_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    return_tokens_as_token_ids: Any = None
    user: str | None = None


class CompletionRequest(_SamplingFields):
    # One prompt per request: a string, a token-id list, or a one-element batch of either.
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool | None = False  # the prompt before the completion (with its logprobs when logprobs is set)
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object as text, as OpenAI returns it


class ToolCall(_Strict):
    """A call an assistant made, sent back in its message of the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # passed to the chat template
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls (serve/tools.py)
    tool_call_id: str | None = None  # a tool message: the call it answers
    # an assistant's earlier thinking (vLLM's names; the template sees both, Qwen3's reads reasoning_content)
    reasoning: str | None = None
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str = Field(min_length=1)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # absent: the rest of the context window (vLLM)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    # "none", "auto", "required" or {"type": "function", "function": {"name": ...}} (serve/tools.py)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call
    # vLLM's chat extensions at their defaults only (refused otherwise)
    echo: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None  # vLLM's: generation continues the last message (checked in prepare)
    chat_template: Any = None
    chat_template_kwargs: Any = None
    documents: Any = None


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # vLLM's: default true for a prompt, false for messages
    add_generation_prompt: Any = None  # vLLM's, for messages: as in a chat request
    chat_template_kwargs: Any = None
    return_token_strs: bool | None = False  # vLLM's: the tokens' strings too ("token_strs")
    # for messages, as in a chat request
    tools: list[Tool] | None = None
    continue_final_message: Any = None
    chat_template: Any = None
    documents: Any = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
