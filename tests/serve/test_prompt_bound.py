"""The prompt bound never refuses a text that fits: no text is longer than (chars per token) x
(its token count). Checked on byte-level BPE tokenizers, with and without a composing normalizer."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

tokenizers = pytest.importorskip("tokenizers")
from adaspec import testing  # noqa: E402
from adaspec.models.tokenizer import Tokenizer  # noqa: E402
from adaspec.serve.prompt_bound import PromptBound, max_chars_per_token  # noqa: E402


def _wrap(hf) -> Tokenizer:
    return Tokenizer(hf, {}, set())


@pytest.fixture(scope="module")
def plain():
    return _wrap(testing.make_byte_level_tokenizer())


@pytest.fixture(scope="module")
def nfc():
    hf = testing.make_byte_level_tokenizer()
    hf.normalizer = tokenizers.normalizers.NFC()
    return _wrap(hf)


# code, plain text, and what composes under NFC: Hangul jamo, Latin/Greek with combining marks
texts = st.one_of(
    st.text(max_size=200),
    st.lists(st.sampled_from(list("def fib(n):\n    return  \t{}()[]=+-*") + [" " * 8]), max_size=300).map("".join),
    st.lists(st.sampled_from(["\u1100", "\u1161", "\u11a8", "e", "\u0301", "\u03c9", "\u0314", "\u0345",
                              "o", "\u031b", "\u0323", "<|im_start|>"]), max_size=200).map("".join),
)


@settings(max_examples=300, deadline=None)
@given(text=texts)
def test_no_text_is_longer_than_the_bound_for_its_token_count(plain, nfc, text):
    for tok in (plain, nfc):
        per_token = max_chars_per_token(tok)
        assert per_token is not None
        n = len(tok.encode(text))
        assert len(text) <= per_token * n or (n == 0 and text == ""), (text, n, per_token)
        # and the text-dependent bound (no composition margin for text already in NFC)
        assert len(text) <= PromptBound.of(tok).per_token(text) * n or text == ""
        assert PromptBound.of(tok).cannot_fit(text, n) is False


def _trained(normalizer, pre, decoder, corpus):
    from tokenizers import Tokenizer as HF
    from tokenizers import models, trainers

    hf = HF(models.BPE())
    hf.normalizer, hf.pre_tokenizer, hf.decoder = normalizer, pre, decoder
    alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet() if decoder.__class__.__name__ == "ByteLevel" else []
    hf.train_from_iterator(corpus * 50, trainer=trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet,
                                                                    show_progress=False))
    return _wrap(hf)


def test_tight_cases_composition_and_a_stripped_leading_space():
    import unicodedata

    pt, dec, norm = tokenizers.pre_tokenizers, tokenizers.decoders, tokenizers.normalizers
    # NFC: 8 decomposed jamo become the 3 syllables of one token ("한국어")
    hangul = _trained(norm.NFC(), pt.ByteLevel(add_prefix_space=False), dec.ByteLevel(), ["한국어 한국어"])
    text = unicodedata.normalize("NFD", "한국어")
    assert len(hangul.encode(text)) == 1 and len(text) == 8
    assert len(text) <= max_chars_per_token(hangul)
    assert len(text) <= PromptBound.of(hangul).per_token(text)  # not in NFC: the margin applies
    # Metaspace: "▁thethe" covers 7 characters, but decoded alone it is "thethe"
    meta = _trained(None, pt.Metaspace(), dec.Metaspace(), ["the the thethe"])
    assert len(meta.encode(" thethe")) == 1
    assert len(" thethe") <= max_chars_per_token(meta)


def test_the_bound_scales_with_max_model_len(plain):
    per = max_chars_per_token(plain)
    assert not PromptBound.of(plain).cannot_fit("x" * 100 * per, 100)
    assert PromptBound.of(plain).cannot_fit("x" * (100 * per + 1), 100)


def test_text_already_in_nfc_needs_no_composition_margin(nfc):
    b = PromptBound.of(nfc)
    assert b.per_token("plain ascii, and 한국어 composed") * 8 == b.per_token()
    assert b.per_token("\u1100\u1161") == b.per_token()  # decomposed jamo: the margin applies


@pytest.mark.parametrize("make", [
    lambda t: setattr(t, "pre_tokenizer", tokenizers.pre_tokenizers.Whitespace()),
    lambda t: setattr(t, "normalizer", tokenizers.normalizers.Strip()),
    lambda t: setattr(t, "normalizer", tokenizers.normalizers.Replace(tokenizers.Regex(r"\s+"), " ")),
    lambda t: setattr(t, "normalizer", tokenizers.normalizers.BertNormalizer()),
])
def test_no_bound_where_the_tokenizer_may_delete_text(make):
    hf = testing.make_byte_level_tokenizer()
    make(hf)
    assert max_chars_per_token(_wrap(hf)) is None


def test_a_tokenizer_without_a_known_pipeline_has_no_bound():
    class Opaque:
        def encode(self, text):
            return []

    assert PromptBound.of(Opaque()) is None
