import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaspec.train.tokenizer import SPECIAL_TOKENS, load_raw

SHIPPED = Path(__file__).resolve().parents[2] / "adaspec" / "assets" / "models" / "tiny"

PY_SAMPLES = [
    "def f(x):\n\treturn x  # tab-indented\r\n",
    "s = 'héllo wörld – ☃ 日本語 🐍'\nprint(s.encode('utf-8'))\n",
    "class Ünïcode:\n    π = 3.14159\n    def __repr__(self):\n        return f'<{self.π!r}>'\n",
    "    \n\n\n        trailing   spaces   \n",
    "x = '<|endoftext|>'  # a special token inside source\n",
    "",
]


@pytest.fixture(params=["micro", "shipped"])
def tok(request, micro_tokenizer):
    if request.param == "shipped":
        if not (SHIPPED / "tokenizer.json").is_file():
            pytest.skip("tiny's tokenizer is not committed yet")
        return load_raw(SHIPPED)
    return load_raw(micro_tokenizer)


def roundtrip(tok, s: str) -> str:
    return tok.decode(tok.encode(s, add_special_tokens=False).ids, skip_special_tokens=False)


@pytest.mark.parametrize("src", PY_SAMPLES)
def test_roundtrip_python_source(tok, src):
    assert roundtrip(tok, src) == src


def test_roundtrip_real_module(tok):
    import inspect
    import textwrap

    src = inspect.getsource(textwrap)
    assert roundtrip(tok, src) == src


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_roundtrip_arbitrary_text(micro_tokenizer, s):
    assert roundtrip(load_raw(micro_tokenizer), s) == s


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["def ", "x", " = ", "'é'", "\n", "    ", "\t", "(", ")", ":", "λ", "#", "\r\n"]),
                max_size=60).map("".join))
def test_roundtrip_code_like_text(micro_tokenizer, s):
    assert roundtrip(load_raw(micro_tokenizer), s) == s


def test_special_tokens_first_and_config(micro_tokenizer):
    t = load_raw(micro_tokenizer)
    assert [t.token_to_id(s) for s in SPECIAL_TOKENS] == [0, 1, 2, 3]
    cfg = json.loads((micro_tokenizer / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == cfg["pad_token"] == "<|endoftext|>" and cfg["mask_token"] == "<|mask|>"
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and cfg["chat_template"]


def test_autotokenizer_loads(tok, micro_tokenizer):
    transformers = pytest.importorskip("transformers")
    path = micro_tokenizer if tok.get_vocab_size() == 512 else SHIPPED
    at = transformers.AutoTokenizer.from_pretrained(str(path))
    src = PY_SAMPLES[2]
    ids = at(src, add_special_tokens=False)["input_ids"]
    assert ids == tok.encode(src, add_special_tokens=False).ids
    assert at.decode(ids) == src
    assert at.eos_token_id == at.pad_token_id == 0 and at.mask_token_id == 1
    chat = at.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_adaspec_tokenizer_wrapper_reads_it(micro_model):
    from adaspec.models.tokenizer import Tokenizer

    t = Tokenizer.from_dir(micro_model)
    assert 0 in t.eos_token_ids
    assert t.decode(t.encode("x = 'é'\n")) == "x = 'é'\n"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["def f(x):", "    return x", "        y = 1", "", "class A:", "\tpass", "# é"]),
                min_size=2, max_size=12))
def test_prefix_cut_at_a_line_boundary_tokenizes_as_in_the_full_text(micro_tokenizer, lines):
    """A prompt ending in a newline must tokenize exactly as that part of the whole file does."""
    tok = load_raw(micro_tokenizer)
    full = "\n".join(lines) + "\n"
    cut = full.index("\n") + 1
    prefix_ids = tok.encode(full[:cut], add_special_tokens=False).ids
    assert tok.encode(full, add_special_tokens=False).ids[: len(prefix_ids)] == prefix_ids
