"""Tokenizer.token_bytes (models/token_bytes.py): each token's own bytes, a piece of a UTF-8
character included, so that a text's tokens' bytes join into its UTF-8 (OpenAI's logprob `bytes`)."""
import pytest
from hypothesis import given, settings, strategies as st
from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from adaspec.models.registry import resolve_model_path
from adaspec.models.token_bytes import byte_level_chars
from adaspec.models.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny():
    return Tokenizer.from_dir(resolve_model_path("tiny"))


def test_the_byte_level_table_covers_each_byte_once():
    chars = byte_level_chars()
    assert sorted(chars.values()) == list(range(256)) and chars["A"] == 65 and chars["\u0120"] == 32  # "Ġ": space


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.sampled_from("ab é世界🎉\n\t_(){}"), max_size=40))
def test_a_byte_level_texts_token_bytes_join_into_its_utf8(tiny, text):
    assert b"".join(tiny.token_bytes(t) for t in tiny.encode(text)) == text.encode()


def test_a_token_that_is_half_a_character_has_that_half(tiny):
    ids = tiny.encode("é")
    assert len(ids) == 2 and tiny.decode(ids[:1]) == "\ufffd"  # half a character: its text cannot say which
    assert [tiny.token_bytes(t) for t in ids] == [b"\xc3", b"\xa9"]


def _sentencepiece_like():
    """A Llama-2-style tokenizer: U+2581 for spaces, <0xNN> byte pieces for what has no piece."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "\u2581hi": 257, "\u2581": 258, "x": 259}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return Tokenizer(tok, {}, set())


def test_sentencepiece_pieces_and_byte_fallback():
    tok = _sentencepiece_like()
    ids = tok.encode("hi é")
    assert b"".join(tok.token_bytes(t) for t in ids) == " hi é".encode()  # Metaspace's leading space
    assert tok.token_bytes(1 + 0xC3) == b"\xc3" and tok.token_bytes(257) == b" hi"


def test_chat_logprobs_bytes_rebuild_the_content(tiny):
    """The server's chat logprobs: each token's `bytes` are its own, so a client can join them into
    the content even where a token holds half a character (they were U+FFFD's three bytes)."""
    from adaspec.serve.formatting import LogprobFormatter

    ids = tiny.encode("é!")
    out = LogprobFormatter(tiny, 1).chat(ids, [{t: -0.5} for t in ids])["content"]
    assert bytes(b for entry in out for b in entry["bytes"]).decode() == "é!"
    assert [e["top_logprobs"][0]["bytes"] for e in out] == [e["bytes"] for e in out]
