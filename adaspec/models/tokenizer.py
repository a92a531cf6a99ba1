"""Tokenizer: a `tokenizers.Tokenizer` plus what tokenizer_config.json / generation_config.json add.

EOS ids are the union of generation_config.json's and config.json's `eos_token_id` and the
id of tokenizer_config.json's `eos_token`. The chat template comes from tokenizer_config.json;
a model without one gets DEFAULT_CHAT_TEMPLATE (ChatML, documented in the README). Templates render
as transformers' apply_chat_template renders them (what vLLM's chat runs), so that a Hugging Face
checkpoint's own template gives the same prompt here.
"""
from __future__ import annotations

import json
import threading
from datetime import datetime
from pathlib import Path

from adaspec.errors import InvalidRequestError, ModelLoadError

# ChatML, and with ``tools`` the Hermes convention (the one Qwen2.5 and Hermes models use, and the
# one `--tool-call-parser hermes` reads back): the tools' JSON schemas in a system message, an
# assistant's calls as <tool_call>{"name": ..., "arguments": {...}}</tool_call>. Messages without
# tools render as plain ChatML: "<|im_start|>{role}\n{content}<|im_end|>\n" each, then
# "<|im_start|>assistant\n". The models adaspec trains ship it (train/tokenizer.py).
DEFAULT_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{{- ('\n' if message['content'] or not loop.first else '') + '<tool_call>\n{\"name\": ' "
    "+ (call['function']['name'] | tojson) + ', \"arguments\": ' + (call['function']['arguments'] | tojson) "
    "+ '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


def _token_str(v):
    return v.get("content") if isinstance(v, dict) else v


def _read_optional_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path.name} is not valid JSON ({path}): {e}") from None
    return data if isinstance(data, dict) else {}


def config_eos_token_ids(path: str | Path, model_config: dict | None = None) -> set[int]:
    """EOS ids named by generation_config.json and config.json: all an engine without a
    tokenizer (skip_tokenizer_init) knows; Tokenizer.from_dir adds tokenizer_config's eos_token."""
    gcfg = _read_optional_json(Path(path) / "generation_config.json")
    eos: set[int] = set()
    for src in (gcfg.get("eos_token_id"), (model_config or {}).get("eos_token_id")):
        if isinstance(src, int):
            eos.add(src)
        elif isinstance(src, list):
            eos.update(int(x) for x in src)
    return eos


# what apply_chat_template gives the template itself (or takes as its own arguments): not keywords
# a caller may pass through to the template
TEMPLATE_SET_BY_ADASPEC = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tokenize",
                                     "tools", "documents", "chat_template", "continue_final_message"})
_MAX_COMPILED_TEMPLATES = 64
# appended to the message to continue, so that the rendered text can be cut right after it
_CONTINUE_MARK = "<<adaspec: continue the final message>> "


def check_template_kwargs(template_kwargs: dict | None) -> None:
    """Keywords for the chat template a caller passes through (vLLM's chat_template_kwargs): an
    object of string keys, none of them one adaspec sets itself."""
    if template_kwargs is None:
        return
    if not isinstance(template_kwargs, dict) or not all(isinstance(k, str) for k in template_kwargs):
        raise InvalidRequestError(f"chat_template_kwargs must be an object, got {template_kwargs!r}",
                                  param="chat_template_kwargs")
    taken = sorted(set(template_kwargs) & TEMPLATE_SET_BY_ADASPEC)
    if taken:
        raise InvalidRequestError(f"chat_template_kwargs {taken} are set by adaspec itself (add_generation_prompt "
                                  "is an argument of its own)", param="chat_template_kwargs")


def message_text(content, where: str) -> str:
    """A message's content as the template reads it: a string, or OpenAI's list of text parts
    joined (what the server's ChatMessage.text() does); any other part is refused, naming it."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise InvalidRequestError(f"{where} must be a string or a list of {{\"type\": \"text\", \"text\": ...}} "
                              f"parts, got {content!r}", param=where)


def message_for_template(message: dict, where: str) -> dict:
    """One chat message as templates read it (where: how errors name it, e.g. "messages.0"): its
    content as text (none: empty); an assistant's tool_calls with their arguments parsed (only an
    assistant's); its reasoning under both names templates read (Qwen3's reads reasoning_content),
    as vLLM passes them; every other field as sent (name, tool_call_id)."""
    content = message.get("content")
    out = {**message, "content": "" if content is None else message_text(content, f"{where}.content")}
    if message.get("tool_calls"):
        if message.get("role") != "assistant":
            raise InvalidRequestError(f"Only an assistant message carries tool_calls, not a {message.get('role')} "
                                      "message", param=f"{where}.tool_calls")
        out["tool_calls"] = [call_for_template(c, f"{where}.tool_calls.{j}") for j, c in enumerate(message["tool_calls"])]
    reasoning = message.get("reasoning", message.get("reasoning_content"))
    if reasoning is not None:
        out["reasoning"] = out["reasoning_content"] = reasoning
    return out


def call_for_template(call: dict, where: str) -> dict:
    """An assistant's earlier tool call as chat templates read it: its arguments, JSON text in
    OpenAI's messages, parsed (templates write them with tojson; transformers and vLLM pass them so)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError(f"{where} must be {{\"id\": ..., \"type\": \"function\", \"function\": "
                                  f"{{\"name\": ..., \"arguments\": ...}}}}, got {call!r}", param=where)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{where}.function.arguments must be JSON text: {e}",
                                      param=f"{where}.function.arguments") from None
    return {**call, "type": call.get("type", "function"), "function": {**function, "arguments": arguments}}


class Tokenizer:
    def __init__(self, tok, tokenizer_config: dict, eos_ids: set[int]):
        self._tok = tok
        self.config = tokenizer_config
        self.eos_token_ids = eos_ids
        # one template, or a model's named ones (Hugging Face's list of {"name", "template"})
        self.chat_template: str | dict[str, str] = _named_templates(tokenizer_config.get("chat_template")) \
            or DEFAULT_CHAT_TEMPLATE
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._compiled_templates: dict[str, object] = {}
        self._templates_lock = threading.Lock()

    def __getstate__(self) -> dict:
        # the engine process sends its tokenizer to the API servers: compiled templates and the lock stay
        return {k: v for k, v in self.__dict__.items() if k not in ("_compiled_templates", "_templates_lock",
                                                                    "_token_bytes")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _compiled_templates={}, _templates_lock=threading.Lock())

    @classmethod
    def from_dir(cls, path: str | Path, model_config: dict | None = None) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.exists():
            raise ModelLoadError(f"tokenizer.json not found in {path}")
        try:
            tok = HFTokenizer.from_file(str(tj))
        except Exception as e:  # the Rust library raises a plain Exception on a bad file
            raise ModelLoadError(f"corrupt tokenizer.json in {path}: {e}") from None
        tcfg = _read_optional_json(path / "tokenizer_config.json")
        jinja = path / "chat_template.jinja"  # where transformers saves a template now; it wins, as there
        if jinja.exists():
            tcfg = {**tcfg, "chat_template": jinja.read_text(encoding="utf-8")}
        eos = config_eos_token_ids(path, model_config)
        name = _token_str(tcfg.get("eos_token"))
        if name is not None and tok.token_to_id(name) is not None:
            eos.add(tok.token_to_id(name))
        return cls(tok, tcfg, eos)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """add_special_tokens: the tokenizer's post-processor adds its special tokens (a Llama
        tokenizer's BOS), as vLLM encodes a text prompt; off for chat-templated text, whose
        template writes them, and for text that continues other text."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> "IncrementalDecoder":
        """An incremental detokenizer: O(1) work per token instead of decoding the whole output
        again every step (the tokenizers library's DecodeStream, as vLLM's fast detokenizer)."""
        return IncrementalDecoder(self._tok, skip_special_tokens)

    def backend_json(self) -> str:
        """The tokenizers.Tokenizer as its tokenizer.json text (llguidance reads it:
        sample/structured_outputs.py)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def token_bytes(self, i: int) -> bytes:
        """The token's own bytes, part of a UTF-8 character included (models/token_bytes.py)."""
        table = self.__dict__.get("_token_bytes")
        if table is None:
            from adaspec.models.token_bytes import TokenBytes

            table = self._token_bytes = TokenBytes(self._tok)
        return table(i)

    # -- what code written for a transformers tokenizer (vLLM's get_tokenizer()) reads ------------
    def __len__(self) -> int:
        return self.vocab_size

    @property
    def eos_token_id(self) -> int | None:
        """tokenizer_config's eos_token (as transformers), else the lowest of the EOS ids."""
        named = _token_str(self.config.get("eos_token"))
        tid = self._tok.token_to_id(named) if named is not None else None
        return tid if tid is not None else (min(self.eos_token_ids) if self.eos_token_ids else None)

    def convert_ids_to_tokens(self, ids: int | list[int]):
        return self.id_to_token(ids) if isinstance(ids, int) else [self.id_to_token(i) for i in ids]

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = False,
                            tools: list[dict] | None = None, documents: list[dict] | None = None,
                            chat_template: str | None = None, continue_final_message: bool = False,
                            **template_kwargs) -> str | list[int]:
        """The messages through the chat template: its text, or (tokenize=True) that text's token
        ids, the template having written any special tokens (transformers' signature). ``tools``
        (OpenAI's function definitions), ``documents`` (for a retrieval template) and extra keywords
        (e.g. Qwen3's enable_thinking) reach the template; ``chat_template``, a template or the name of
        one of the model's, replaces the model's. ``continue_final_message``: the text ends inside
        the last message, right after its content (whatever the template writes after a message is
        cut), so that generation continues it, e.g. an assistant reply begun by the caller; it
        excludes add_generation_prompt."""
        template = self.template_text(chat_template, tools)
        if not continue_final_message:
            text = self._render(messages, add_generation_prompt, tools, documents, template, template_kwargs)
            return self.encode(text) if tokenize else text
        if add_generation_prompt:
            raise InvalidRequestError("continue_final_message continues the last message: it cannot also add a "
                                      "generation prompt (set add_generation_prompt to false)",
                                      param="continue_final_message")
        final = messages[-1].get("content") if messages and isinstance(messages[-1], dict) else None
        if not isinstance(final, str):
            raise InvalidRequestError("continue_final_message needs a last message with text content to continue",
                                      param="continue_final_message")
        marked = list(messages[:-1]) + [{**messages[-1], "content": final + _CONTINUE_MARK}]
        text = self._render(marked, False, tools, documents, template, template_kwargs)
        at = text.find(_CONTINUE_MARK.strip())  # (a template that writes the content twice: cut at the first)
        if at < 0:
            raise InvalidRequestError("the chat template does not write the last message's content, so it cannot be "
                                      "continued", param="continue_final_message")
        # a template that strips a message's trailing whitespace stripped the mark's too
        text = text[:at] if text.startswith(_CONTINUE_MARK, at) else text[:at].rstrip()
        return self.encode(text) if tokenize else text

    def template_text(self, chat_template: str | None = None, tools: list[dict] | None = None) -> str:
        """Which template renders, as transformers picks: the one given (or the model's of that
        name), else the model's own; of named ones "tool_use" when tools are given and it exists,
        else "default"."""
        named = self.chat_template if isinstance(self.chat_template, dict) else {"default": self.chat_template}
        if chat_template is not None:
            if chat_template in named:
                return named[chat_template]
            if "{" not in chat_template:  # a name (or a path) mistaken: it would be every prompt, word for word
                raise InvalidRequestError(f"chat template {chat_template!r} is neither one of this model's named "
                                          f"templates ({sorted(named)}) nor a Jinja template", param="chat_template")
            return chat_template
        if tools and "tool_use" in named:
            return named["tool_use"]
        if "default" not in named:
            raise InvalidRequestError(f"this model's chat templates are named {sorted(named)}, none of them "
                                      "'default': name one as the chat template", param="chat_template")
        return named["default"]

    def compiled_template(self, text: str):
        """The template compiled (once per text); a template that is not Jinja is an InvalidRequestError."""
        import jinja2

        with self._templates_lock:  # the server renders on its event loop and in worker threads
            template = self._compiled_templates.get(text)
        if template is None:
            try:
                template = _template_environment().from_string(text)
            except jinja2.TemplateSyntaxError as e:
                raise InvalidRequestError(f"the chat template does not compile: {e} (line {e.lineno})",
                                          param="chat_template") from None
            with self._templates_lock:
                if len(self._compiled_templates) >= _MAX_COMPILED_TEMPLATES:  # requests' own: a bounded few
                    self._compiled_templates.pop(next(iter(self._compiled_templates)))
                self._compiled_templates[text] = template
        return template

    def _render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None,
                documents: list[dict] | None, template: str, template_kwargs: dict) -> str:
        import jinja2

        check_template_kwargs(template_kwargs)
        compiled = self.compiled_template(template)
        try:
            return compiled.render(
                **template_kwargs,
                messages=messages,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                bos_token=_token_str(self.config.get("bos_token")) or "",
                eos_token=_token_str(self.config.get("eos_token")) or "",
            )
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"chat template failed on these messages: {e}", param="messages") from None
        except (TypeError, ValueError, ArithmeticError, LookupError, RecursionError) as e:  # the template's own code
            raise InvalidRequestError(f"chat template failed on these messages: {type(e).__name__}: {e}",
                                      param="messages") from None


def _named_templates(value) -> str | dict[str, str] | None:
    """tokenizer_config's chat_template: a string, or Hugging Face's list of named templates."""
    if isinstance(value, list):
        return {t["name"]: t["template"] for t in value if isinstance(t, dict) and "name" in t and "template" in t}
    return value if isinstance(value, str) and value else None


def _template_environment():
    """The environment transformers renders chat templates in: sandboxed, trim_blocks and
    lstrip_blocks, loop controls, a tojson that keeps unicode and takes json.dumps' options, and
    the raise_exception and strftime_now globals; an undefined variable is empty, not an error
    (Qwen3's template asks `if tools` of a variable that only exists when tools are passed)."""
    import jinja2.ext

    env = _sandbox()(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _generation_tag()])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


_MAX_REPEAT = 1_000_000  # characters or items one * may make in a template
_MAX_POWER = 1_000


def _sandbox():
    """transformers' sandbox (no attribute access that could escape), which also refuses the
    arithmetic a hostile template (a request's own, --trust-request-chat-template) could use to take
    the server's memory: 'a' * 10**10. (jinja's sandbox already bounds range() to 100,000.)"""
    from jinja2.exceptions import SecurityError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > _MAX_POWER:
                raise SecurityError(f"a chat template may not raise to a power above {_MAX_POWER}")
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > _MAX_REPEAT:
                        raise SecurityError(f"a chat template may not repeat a text or list to more than "
                                            f"{_MAX_REPEAT:,} characters or items")
            return super().call_binop(context, operator, left, right)

    return Sandbox


def _generation_tag():
    """transformers' {% generation %} ... {% endgeneration %} (it marks the assistant's tokens for
    training masks): here the body renders as it stands."""
    import jinja2.ext

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return GenerationTag


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt's tool schemas
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(msg):
    raise InvalidRequestError(str(msg), param="messages")


class IncrementalDecoder:
    """Text of a growing token sequence, one token at a time. `text` only grows; a token that
    ends inside a UTF-8 character adds nothing until the character is complete."""

    def __init__(self, hf_tokenizer, skip_special_tokens: bool):
        from tokenizers.decoders import DecodeStream

        self._tok, self._stream, self.text = hf_tokenizer, DecodeStream(skip_special_tokens=skip_special_tokens), ""

    def step(self, token_id: int) -> str:
        piece = self._stream.step(self._tok, token_id)
        if piece:
            self.text += piece
        return self.text
