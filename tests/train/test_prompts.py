import json

import pytest

from adaspec.errors import AdaspecError
from adaspec.train.prompts import PROMPTS_DIR, build_prompts, load_prompt_set, write_prompt_set


def test_eval_code_ships_and_loads_by_name():
    path = PROMPTS_DIR / "eval-code.jsonl"
    assert path.stat().st_size < 1.5e6
    prompts = load_prompt_set("eval-code")
    assert len(prompts) == 500 and len(set(prompts)) == 500
    assert all(p.endswith("\n") and p.strip() for p in prompts)
    for line in path.read_text(encoding="utf-8").splitlines():
        assert list(json.loads(line)) == ["prompt"]  # vllm bench serve custom format
    meta = json.loads((PROMPTS_DIR / "eval-code.meta.json").read_text())
    assert meta["source_split"] == "test" and meta["num_prompts"] == 500


def test_load_by_path_and_unknown_name(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "def f():\\n"}\n\n{"prompt": "x = 1\\n"}\n')
    assert load_prompt_set(f) == ["def f():\n", "x = 1\n"]
    with pytest.raises(AdaspecError, match="eval-code"):
        load_prompt_set("no-such-set")


def test_build_prompts_from_test_split(micro_corpus, micro_tokenizer, tmp_path):
    from adaspec.train.tokenizer import load_raw

    prompts = build_prompts(micro_corpus, micro_tokenizer, num=20, min_tokens=16, max_tokens=128, seed=3)
    assert prompts == build_prompts(micro_corpus, micro_tokenizer, num=20, min_tokens=16, max_tokens=128, seed=3)
    tok = load_raw(micro_tokenizer)
    test_text = (micro_corpus / "test.jsonl").read_text(encoding="utf-8")
    train_docs = [json.loads(line)["text"] for line in open(micro_corpus / "train.jsonl", encoding="utf-8")]
    for p in prompts:
        assert 16 <= len(tok.encode(p).ids) <= 128 and p.endswith("\n")
        assert json.dumps(p)[1:-1][:60] in test_text
        assert not any(p in d for d in train_docs)
    write_prompt_set(prompts, tmp_path / "x.jsonl", {"n": 20})
    assert load_prompt_set(tmp_path / "x.jsonl") == prompts
