"""The bytes of one token, for OpenAI's logprob `bytes` fields: a token may hold part of a UTF-8
character, whose decoded text is U+FFFD and so cannot give the bytes back (the field exists so
that a client can join the tokens' bytes into the text).

Read from the token's own string, the way the tokenizer's decoder reads it: byte-level BPE (GPT-2,
Qwen, Llama 3) spells each byte as one character of a fixed table; SentencePiece-style models spell
a space as U+2581 and a byte they have no piece for as "<0xNN>" (byte fallback). Other decoders,
and added (special) tokens, give their decoded text's UTF-8."""
from __future__ import annotations

import json
import re

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's character for each byte, inverted: the printable Latin-1 bytes stand for
    themselves, the other 68 take the characters from U+0100 on, in byte order (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _decoder_kinds(spec) -> set[str]:
    """The decoder types of a tokenizer.json "decoder" entry, a Sequence's members included."""
    if not isinstance(spec, dict):
        return set()
    kinds = {spec.get("type")}
    for member in spec.get("decoders") or []:
        kinds |= _decoder_kinds(member)
    return kinds


class TokenBytes:
    """token id -> its bytes, for one tokenizers.Tokenizer (built once, lazily, by Tokenizer)."""

    def __init__(self, hf_tokenizer):
        self._tok = hf_tokenizer
        spec = json.loads(hf_tokenizer.to_str())
        kinds = _decoder_kinds(spec.get("decoder"))
        self._byte_level = byte_level_chars() if "ByteLevel" in kinds else None
        self._byte_fallback = "ByteFallback" in kinds or bool((spec.get("model") or {}).get("byte_fallback"))
        self._metaspace = "Metaspace" in kinds or any(
            d.get("type") == "Replace" and (d.get("pattern") or {}).get("String") == "\u2581"
            for d in (spec.get("decoder") or {}).get("decoders") or [] if isinstance(d, dict))
        self._added = set(hf_tokenizer.get_added_tokens_decoder())

    def __call__(self, token_id: int) -> bytes:
        piece = self._tok.id_to_token(token_id)
        if piece is None or token_id in self._added:
            return self._tok.decode([token_id], skip_special_tokens=False).encode()
        if self._byte_level is not None and all(c in self._byte_level for c in piece):
            return bytes(self._byte_level[c] for c in piece)
        if self._byte_fallback:
            m = _BYTE_PIECE.fullmatch(piece)
            if m:
                return bytes([int(m.group(1), 16)])
        if self._metaspace:
            return piece.replace("\u2581", " ").encode()
        return self._tok.decode([token_id], skip_special_tokens=False).encode()
