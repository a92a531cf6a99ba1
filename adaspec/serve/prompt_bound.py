"""The longest text that could still fit in ``max_model_len`` tokens, from the vocabulary alone.

Tokenizing a 50 MB prompt takes tens of seconds; a text that cannot fit is refused before that.
The bound must never refuse a prompt that fits, so it is only derived where it is sound:

- every token covers at most ``C`` characters of the (normalized) text, where ``C`` is the
  longest single-token decode (special tokens included), plus one for a Metaspace/ByteLevel
  decoder that strips a leading space when a token is decoded alone. For byte-level BPE a token
  holding part of a multi-byte character decodes to one U+FFFD per started character, so it
  still covers at most its decode's length in character starts.
- normalization may shrink the text: NFC/NFKC compose up to a handful of code points into one
  (Hangul jamo 3:1, Greek with three diacritics 4:1); ``_COMPOSE`` leaves a wide margin. When
  the normalizer is that one form alone (Qwen's NFC) and the text is already in it (checked in
  linear time, true of nearly all text), nothing shrinks and the margin is not needed.
  Anything that may delete characters (a regex Replace, Strip, BERT's normalizer, sentencepiece's
  Precompiled charsmap, which folds runs of spaces, whitespace-dropping pre-tokenizers) gives
  no bound at all: such prompts are simply tokenized (off the event loop, under the body cap).
"""
from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass

_COMPOSE = 8  # max code points NFC/NFKC may fold into one, with margin
_LENGTH_KEEPING_NORMALIZERS = {"NFD", "NFKD", "Lowercase", "Prepend"}
_COMPOSING_NORMALIZERS = {"NFC", "NFKC"}
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"}


def _normalizer_factor(n: dict | None) -> int | None:
    """How many input characters one normalized character may stand for (None: unbounded)."""
    if n is None:
        return 1
    kind = n.get("type")
    if kind == "Sequence":
        factor = 1
        for sub in n.get("normalizers", []):
            f = _normalizer_factor(sub)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in _COMPOSING_NORMALIZERS:
        return _COMPOSE
    if kind in _LENGTH_KEEPING_NORMALIZERS:
        return 1
    if kind == "Replace":  # a literal string replaced by one at least as long keeps the length
        pattern, content = n.get("pattern", {}), n.get("content", "")
        if "String" in pattern and len(content) >= len(pattern["String"]) >= 1:
            return 1
    return None


def _pre_tokenizer_keeps_text(p: dict | None) -> bool:
    if p is None:
        return True
    kind = p.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_text(sub) for sub in p.get("pretokenizers", []))
    if kind in ("Split", "Punctuation"):
        return p.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


@dataclass(frozen=True)
class PromptBound:
    """Per-token character bounds of one tokenizer (see the module docstring)."""

    chars_per_token: int  # in the normalized text
    shrink: int = 1  # normalized characters one input character may stand for at worst
    single_form: str | None = None  # the normalizer is this Unicode form alone (NFC, NFKC)

    @classmethod
    def of(cls, tokenizer) -> "PromptBound | None":
        own = getattr(tokenizer, "max_chars_per_token", None)  # a tokenizer that knows it says so
        if isinstance(own, int):
            return cls(own)
        hf = getattr(tokenizer, "_tok", None)  # adaspec.models.tokenizer.Tokenizer wraps tokenizers'
        if hf is None or not hasattr(hf, "to_str"):
            return None
        spec = json.loads(hf.to_str())
        normalizer = spec.get("normalizer")
        factor = _normalizer_factor(normalizer)
        if factor is None or not _pre_tokenizer_keeps_text(spec.get("pre_tokenizer")):
            return None
        longest = 1
        for i in range(hf.get_vocab_size(with_added_tokens=True)):
            longest = max(longest, len(hf.decode([i], skip_special_tokens=False)))
        for added in spec.get("added_tokens", []):  # matched literally in the raw text
            longest = max(longest, len(added.get("content", "")))
        kind = (normalizer or {}).get("type")
        return cls(longest + 1, factor, kind if kind in _COMPOSING_NORMALIZERS else None)

    def per_token(self, text: str | None = None) -> int:
        """Characters of ``text`` (any text if None) one token may cover."""
        if self.shrink > 1 and text is not None and self.single_form is not None \
                and unicodedata.is_normalized(self.single_form, text):
            return self.chars_per_token  # the normalizer leaves this text as it is
        return self.chars_per_token * self.shrink

    def cannot_fit(self, text: str, max_model_len: int) -> bool:
        """True when no tokenization of ``text`` has fewer than max_model_len + 1 tokens."""
        return len(text) > max_model_len * self.per_token(text)


def max_chars_per_token(tokenizer) -> int | None:
    """Characters one token may cover in any text given to the tokenizer, or None if unbounded."""
    bound = PromptBound.of(tokenizer)
    return None if bound is None else bound.per_token()
