import json
import random

from adaspec.train.corpus import build_corpus, split_of


def _split_map(corpus):
    out = {}
    for split in ("train", "val", "test"):
        for line in open(corpus / f"{split}.jsonl", encoding="utf-8"):
            out[json.loads(line)["path"]] = split
    return out


def test_split_is_a_function_of_the_relative_path():
    paths = [f"pkg{i % 7}/mod_{i}.py" for i in range(2000)]
    first = {p: split_of(p) for p in paths}
    random.Random(1).shuffle(paths)
    assert {p: split_of(p) for p in paths} == first
    counts = {s: sum(v == s for v in first.values()) for s in ("train", "val", "test")}
    assert 1650 < counts["train"] < 1950 and counts["val"] > 50 and counts["test"] > 50
    assert split_of("a/b.py") == "train"  # pinned: the rule must not drift between versions


def test_same_files_give_same_split_whatever_the_order(tmp_path, source_tree):
    src = source_tree
    a = tmp_path / "a"
    build_corpus(a, source=src)
    # the same documents through --jsonl, shuffled: identical assignment
    recs = [json.loads(line) for s in ("train", "val", "test") for line in open(a / f"{s}.jsonl")]
    random.Random(0).shuffle(recs)
    jl = tmp_path / "docs.jsonl"
    jl.write_text("".join(json.dumps(r) + "\n" for r in recs))
    b = tmp_path / "b"
    build_corpus(b, jsonl=jl)
    assert _split_map(a) == _split_map(b)
    for s in ("train", "val", "test"):
        assert (a / f"{s}.jsonl").read_bytes() == (b / f"{s}.jsonl").read_bytes()


def test_non_utf8_skipped_and_counted_site_packages_ignored(micro_corpus):
    stats = json.loads((micro_corpus / "stats.json").read_text())
    assert stats["skipped_not_utf8"] == 1 and stats["skipped_paths"] == ["latin1_module.py"]
    paths = _split_map(micro_corpus)
    assert not any("site-packages" in p for p in paths)
    assert stats["files"] == len(paths) and stats["python_version"]
    assert all(stats["splits"][s]["files"] > 0 for s in ("train", "val", "test"))


def test_cli_builds_corpus(tmp_path, source_tree):
    from adaspec.cli import main

    src = source_tree
    assert main(["train", "corpus", "--source", str(src), "--out", str(tmp_path / "c")]) == 0
    assert (tmp_path / "c" / "stats.json").is_file()
