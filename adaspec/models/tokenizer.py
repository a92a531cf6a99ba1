"""Tokenizer: a `tokenizers.Tokenizer` plus what tokenizer_config.json / generation_config.json add.

EOS ids are the union of generation_config.json's and config.json's `eos_token_id` and the
id of tokenizer_config.json's `eos_token`. The chat template comes from tokenizer_config.json;
a model without one gets DEFAULT_CHAT_TEMPLATE (ChatML, documented in the README).
"""
from __future__ import annotations

import json
from pathlib import Path

from adaspec.errors import InvalidRequestError, ModelLoadError

DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
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
TEMPLATE_SET_BY_ADASPEC = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tokenize"})


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


class Tokenizer:
    def __init__(self, tok, tokenizer_config: dict, eos_ids: set[int]):
        self._tok = tok
        self.config = tokenizer_config
        self.eos_token_ids = eos_ids
        self.chat_template = tokenizer_config.get("chat_template") or DEFAULT_CHAT_TEMPLATE
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._compiled_template = None

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
                            **template_kwargs) -> str | list[int]:
        """The messages through the chat template: its text, or (tokenize=True) that text's token
        ids, the template having written any special tokens (transformers' signature; extra
        keywords, e.g. Qwen3's enable_thinking, reach the template)."""
        text = self._render(messages, add_generation_prompt, template_kwargs)
        return self.encode(text) if tokenize else text

    def _render(self, messages: list[dict], add_generation_prompt: bool, template_kwargs: dict) -> str:
        import jinja2

        check_template_kwargs(template_kwargs)
        if self._compiled_template is None:
            env = jinja2.Environment(undefined=jinja2.StrictUndefined, trim_blocks=False)
            env.globals["raise_exception"] = _raise
            self._compiled_template = env.from_string(self.chat_template)
        try:
            return self._compiled_template.render(
                **template_kwargs,
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=_token_str(self.config.get("bos_token")) or "",
                eos_token=_token_str(self.config.get("eos_token")) or "",
            )
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"chat template failed on these messages: {e}", param="messages") from None


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
