"""Multi-source corpora: keys per source, dedup by content, split stability, per-source stats."""
import json
import shutil

import pytest

from adaspec.errors import AdaspecError
from adaspec.train.corpus import build_corpus, iter_split, resolve_source, split_of
from adaspec.train.tokenizer import EOS, load_raw


def _records(corpus):
    return {json.loads(line)["path"]: (split, json.loads(line))
            for split in ("train", "val", "test") for line in open(corpus / f"{split}.jsonl", encoding="utf-8")}


def _name_in_split(prefix: str, split: str, **pct) -> str:
    """A file name whose key (prefix + name) falls in ``split``."""
    for i in range(10_000):
        name = f"copy_{i}.py"
        if split_of(prefix + name, **pct) == split:
            return name
    raise AssertionError("no such name")


PCT = {"val_pct": 20, "test_pct": 20}


@pytest.fixture
def two_sources(tmp_path, source_tree):
    """A = the micro source tree; B = new files plus exact copies of two of A's files, one landing in a
    more held-out split than the original and one in a less held-out split."""
    a = source_tree
    recs = _records(_build(tmp_path / "only_a", [f"A={a}"]))
    by_split = {s: sorted(p for p, (sp, _) in recs.items() if sp == s) for s in ("train", "test")}
    b = tmp_path / "b"
    (b / "pkg").mkdir(parents=True)
    (b / "pkg" / "new_module.py").write_text("def new_function():\n    return 42\n")
    (b / "pkg" / "other.py").write_text("class Other:\n    pass\n")
    train_a = by_split["train"][0]  # an A file in train ...
    up = _name_in_split("B/", "test", **PCT)  # ... copied to a B name in test: the B copy must win
    shutil.copyfile(a / train_a[len("A/"):], b / up)
    test_a = by_split["test"][0]  # an A file in test ...
    down = _name_in_split("B/", "train", **PCT)  # ... copied to a B name in train: the A copy must stay
    shutil.copyfile(a / test_a[len("A/"):], b / down)
    same = _name_in_split("B/", "train", **PCT).replace("copy_", "zz_copy_")  # B key sorts after A's
    while split_of("B/" + same, **PCT) != "train":
        same = "z" + same
    train_a2 = by_split["train"][1]  # an A file copied to a B name in the same split: the smaller key stays
    shutil.copyfile(a / train_a2[len("A/"):], b / same)
    return a, b, {"train_a": train_a, "up": "B/" + up, "test_a": test_a, "down": "B/" + down,
                  "same_a": train_a2, "same_b": "B/" + same}


def _build(out, sources):
    build_corpus(out, sources=sources, **PCT)
    return out


def test_dedup_keeps_one_copy_in_the_most_held_out_split(tmp_path, two_sources):
    a, b, names = two_sources
    out = _build(tmp_path / "ab", [f"A={a}", f"B={b}"])
    recs = _records(out)
    assert names["up"] in recs and recs[names["up"]][0] == "test"
    assert names["train_a"] not in recs  # dropped: its content is held out under B's key
    assert names["test_a"] in recs and recs[names["test_a"]][0] == "test"
    assert names["down"] not in recs  # the train copy of a test file is dropped
    assert names["same_a"] in recs and names["same_b"] not in recs  # same split: the smaller key
    texts = [r["text"] for _, r in recs.values()]
    assert len(texts) == len(set(texts))  # no content twice
    stats = json.loads((out / "stats.json").read_text())
    src = {s["name"]: s for s in stats["sources"]}
    assert src["A"]["duplicates_dropped"] == 1 and src["B"]["duplicates_dropped"] == 2
    assert stats["duplicates_dropped"] == 3
    # the same corpus whatever the order of the sources (dedup does not depend on the listing)
    swapped = _build(tmp_path / "ba", [f"B={b}", f"A={a}"])
    for split in ("train", "val", "test"):
        assert (out / f"{split}.jsonl").read_bytes() == (swapped / f"{split}.jsonl").read_bytes()


def test_a_files_split_does_not_change_when_sources_are_added(tmp_path, two_sources):
    a, b, names = two_sources
    alone = _records(_build(tmp_path / "a", [f"A={a}"]))
    both = _records(_build(tmp_path / "ab", [f"A={a}", f"B={b}"]))
    kept = [p for p in alone if p in both]
    assert set(alone) - set(kept) == {names["train_a"]}  # only the file whose copy is held out elsewhere
    assert all(both[p][0] == alone[p][0] for p in kept)
    assert all(both[p][1]["source"] == "A" for p in kept)
    assert all(split_of(p, **PCT) == s for p, (s, _) in both.items())  # split = f(key), nothing else


def test_per_source_stats_and_token_counts(tmp_path, two_sources, micro_tokenizer):
    from adaspec.train.data import load_tokens

    a, b, _ = two_sources
    out = _build(tmp_path / "ab", [f"A={a}", f"B={b}"])
    stats = json.loads((out / "stats.json").read_text())
    src = {s["name"]: s for s in stats["sources"]}
    recs = _records(out)
    for name in ("A", "B"):
        mine = [r for _, r in recs.values() if r["source"] == name]
        assert src[name]["files"] == len(mine) > 0
        assert src[name]["bytes"] == sum(len(r["text"].encode()) for r in mine)
        assert src[name]["key_prefix"] == name + "/" and src[name]["roots"]
        for split in ("train", "val", "test"):
            assert src[name]["splits"][split]["files"] == sum(1 for s, r in recs.values()
                                                              if r["source"] == name and s == split)
    assert src["A"]["skipped_not_utf8"] == 1 and src["B"]["skipped_not_utf8"] == 0
    assert sum(s["files"] for s in src.values()) == stats["files"]

    tokens = load_tokens(out, micro_tokenizer, ("train", "val"))
    stats = json.loads((out / "stats.json").read_text())
    for split in ("train", "val"):
        by = stats["tokens"]["splits"][split]["by_source"]
        assert set(by) <= {"A", "B"} and sum(by.values()) == tokens[split].size == stats["tokens"]["splits"][split]["total"]
    assert stats["tokens"]["splits"]["train"]["by_source"]["B"] > 0
    # the packed stream is each document's own encoding, then EOS, in the split file's order
    tok = load_raw(micro_tokenizer)
    want = []
    for r in iter_split(out, "train"):
        want += tok.encode(r["text"], add_special_tokens=False).ids + [tok.token_to_id(EOS)]
    assert tokens["train"].tolist() == want


def test_resolve_source_forms(tmp_path):
    std = resolve_source("stdlib")
    assert std.prefix == "" and (std.roots[0] / "os.py").is_file()
    sp = resolve_source("site-packages")
    assert sp.prefix == "site-packages/" and all(r.is_dir() for r in sp.roots)
    d = tmp_path / "mytree"
    d.mkdir()
    assert resolve_source(str(d)).name == "mytree" and resolve_source(f"x={d}").prefix == "x/"
    with pytest.raises(AdaspecError, match="no such directory"):
        resolve_source(str(tmp_path / "missing"))
    with pytest.raises(AdaspecError, match="given twice"):
        build_corpus(tmp_path / "c", sources=[str(d), f"mytree={d}"])


def test_stdlib_keys_are_unprefixed_as_in_the_tiny_corpus(tmp_path):
    from adaspec.train.corpus import _iter_source_docs

    keys = [k for k, _, _ in _iter_source_docs(resolve_source("stdlib"), (".py",))][:50]
    assert keys and not any(k.startswith(("stdlib/", "/")) for k in keys)


def test_cli_takes_several_sources(tmp_path, two_sources, capsys):
    from adaspec.cli import main

    a, b, _ = two_sources
    assert main(["train", "corpus", "--source", f"A={a}", "--source", str(b), "--out", str(tmp_path / "c")]) == 0
    stats = json.loads((tmp_path / "c" / "stats.json").read_text())
    assert [s["name"] for s in stats["sources"]] == ["A", "b"]
    assert "duplicates" in capsys.readouterr().out


def test_tokenizer_sample_is_deterministic_and_order_free():
    from adaspec.train.tokenizer import sample_records

    recs = [{"path": f"p{i}.py", "text": "x" * (10 + i)} for i in range(200)]
    s1 = sample_records(recs, 500)
    assert 500 <= sum(len(r["text"]) for r in s1) < 500 + 210
    assert s1 == sample_records(list(reversed(recs)), 500)


def test_max_source_bytes_samples_each_source_alone(tmp_path, two_sources):
    a, b, _ = two_sources
    sizes = {f"A/{p.relative_to(a).as_posix()}": p.stat().st_size for p in a.rglob("*.py")
             if "site-packages" not in p.parts}
    cap = sum(sizes.values()) // 3
    alone = _records(_build_capped(tmp_path / "a", [f"A={a}"], cap))
    both = _records(_build_capped(tmp_path / "ab", [f"A={a}", f"B={b}"], cap))
    assert 0 < len(alone) < len(sizes)
    assert sum(sizes[p] for p in alone) < cap + max(sizes.values())
    # A's sample is the same with or without B (dedup aside); B, under the cap, is taken whole
    assert {p for p, (_, r) in both.items() if r["source"] == "A"} <= set(alone)
    sb = {s["name"]: s for s in json.loads((tmp_path / "ab" / "stats.json").read_text())["sources"]}["B"]
    assert sb["found"]["bytes"] < cap and sb["files"] + sb["duplicates_dropped"] == sb["found"]["files"]
    assert all(split_of(p, **PCT) == s for p, (s, _) in both.items())
    stats = json.loads((tmp_path / "a" / "stats.json").read_text())
    assert stats["sources"][0]["found"]["files"] == len(sizes) and stats["max_source_bytes"] == cap


def _build_capped(out, sources, cap):
    build_corpus(out, sources=sources, max_source_bytes=cap, **PCT)
    return out
