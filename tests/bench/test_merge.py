"""Checkpoint ids in a sweep's manifest and points (bench/checkpoint_id.py), the resume that refuses
other weights at the same path, and `adaspec bench merge` (bench/merge.py): repeats pooled only from
sources measured under the same conditions and cells, each measurement counted once."""
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from adaspec.bench.checkpoint_id import checkpoint_sha256, checkpoints
from adaspec.bench.cli import sweep_config_from_args
from adaspec.bench.merge import merge_sweeps
from adaspec.bench.sweep import run_sweep
from adaspec.cli import build_parser, main
from adaspec.errors import AdaspecError

from .fakeserver import FakeServer, Script

HERE = Path(__file__).parent
FAST = Script(chunks=[(0.01, "ab", 2), (0.01, "c", 1)], prompt_tokens=4)


@pytest.fixture(autouse=True)
def clean_commit(monkeypatch):
    """The engine commit the sweeps record: a clean one, whatever state this checkout is in (a
    "-dirty" one is refused by merge unless assumed the same; its own test sets one)."""
    monkeypatch.setenv("ADASPEC_COMMIT", "0123abc")


def _checkpoint(d, weights=b"\x01" * 64):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text('{"hidden_size": 8}')
    (d / "model.safetensors").write_bytes(weights)
    (d / "MODEL_CARD.md").write_text("card")
    return d


def _rewrite(path, data: bytes):
    st = path.stat() if path.exists() else None
    path.write_bytes(data)
    if st:  # a new file: the cache keys on mtime too
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def test_checkpoint_sha256_follows_the_served_files_only(tmp_path):
    d = _checkpoint(tmp_path / "ck")
    first = checkpoint_sha256(d)
    assert len(first) == 64 and checkpoint_sha256(str(d)) == first
    _rewrite(d / "MODEL_CARD.md", b"another card")
    _rewrite(d / "checkpoint.pt", b"optimizer state the engine never loads")
    assert checkpoint_sha256(d) == first
    _rewrite(d / "model.safetensors", b"\x02" + b"\x01" * 63)  # same size, one byte changed
    second = checkpoint_sha256(d)
    assert second != first
    _rewrite(d / "config.json", b'{"hidden_size": 16}')
    assert checkpoint_sha256(d) not in (first, second)
    assert checkpoint_sha256(tmp_path / "missing") is None and checkpoint_sha256("served-name") is None
    assert checkpoint_sha256(None) is None
    (tmp_path / "empty").mkdir()
    assert checkpoint_sha256(tmp_path / "empty") is None
    assert len(checkpoint_sha256("tiny")) == 64  # the embedded target, by name
    # no drafter given for an embedded target: the embedded drafter the engine then uses
    assert checkpoints("tiny", None) == {"model_sha256": checkpoint_sha256("tiny"),
                                         "drafter_sha256": checkpoint_sha256("tiny-dspark")}
    assert checkpoints(str(d), None)["drafter_sha256"] is None


def _started(tmp_path, monkeypatch, out, model, drafter, *extra, arms="none,fixed:3", conc="1,2", repeats=1):
    """A sweep whose servers it starts itself (the fake `serve` launcher), as on the GPU machine."""
    monkeypatch.setenv("FAKE_SERVE_LOG", str(tmp_path / "serve_calls.jsonl"))
    args = build_parser().parse_args(
        ["bench", "sweep", "--model", str(model), "--drafter", str(drafter), "--arms", arms, "--repeats", str(repeats),
         "--num-warmups", "0", "--dataset", "random", "--tokenizer", "tiny", "--output-len", "4", "--out", str(out),
         "--disable-tqdm", "--startup-timeout", "30", *(["--concurrency", conc, "--num-prompts", "2"] if conc else []),
         *extra])
    cfg = sweep_config_from_args(args, log=lambda *a: None)
    cfg.launcher = [sys.executable, str(HERE / "fake_serve_main.py")]
    return run_sweep(cfg)


def _external(server, out, model, *extra, arms=("none",)):
    argv = ["bench", "sweep", "--model", str(model), "--concurrency", "1,2", "--repeats", "1", "--num-prompts", "2",
            "--num-warmups", "0", "--dataset", "random", "--tokenizer", "tiny", "--output-len", "4", "--out", str(out),
            "--disable-tqdm", *extra]
    for a in arms:
        argv += ["--base-url", f"{a}={server.url}"]
    return main(argv)


def test_resume_refuses_other_weights_at_the_same_path(tmp_path, monkeypatch):
    ck, dr = _checkpoint(tmp_path / "pair" / "target"), _checkpoint(tmp_path / "pair" / "drafter", b"\x07" * 32)
    out = tmp_path / "s"
    res = _started(tmp_path, monkeypatch, out, ck, dr)
    m = res["manifest"]
    assert m["checkpoints"] == {"model_sha256": checkpoint_sha256(ck), "drafter_sha256": checkpoint_sha256(dr)}
    p = json.loads((out / "points" / "fixed-3_c1_r0.json").read_text())
    assert p["conditions"]["checkpoints"] == m["checkpoints"]
    assert "checkpoint sha256" in (out / "report.md").read_text()
    # a rebuild writes another drafter to the same path: resuming would mix two builds
    (out / "points" / "fixed-3_c2_r0.json").unlink()
    _rewrite(dr / "model.safetensors", b"\x08" * 32)
    with pytest.raises(AdaspecError, match=r"a resumed sweep must use the same ones. Differing: drafter_sha256 \(the weights at --drafter\)"):
        _started(tmp_path, monkeypatch, out, ck, dr)
    # a sweep from before ids were recorded still resumes, with a note, and the report marks the mixture
    man = json.loads((out / "manifest.json").read_text())
    del man["checkpoints"]
    (out / "manifest.json").write_text(json.dumps(man))
    for f in (out / "points").glob("*.json"):
        d = json.loads(f.read_text())
        del d["conditions"]["checkpoints"]
        f.write_text(json.dumps(d))
    said = []
    monkeypatch.setenv("FAKE_SERVE_LOG", str(tmp_path / "serve_calls.jsonl"))
    args = build_parser().parse_args(
        ["bench", "sweep", "--model", str(ck), "--drafter", str(dr), "--arms", "none,fixed:3", "--repeats", "1",
         "--num-warmups", "0", "--dataset", "random", "--tokenizer", "tiny", "--output-len", "4", "--out", str(out),
         "--disable-tqdm", "--startup-timeout", "30", "--concurrency", "1,2", "--num-prompts", "2"])
    cfg = sweep_config_from_args(args, log=said.append)
    cfg.launcher = [sys.executable, str(HERE / "fake_serve_main.py")]
    res = run_sweep(cfg)
    assert any("recorded no checkpoint sha256" in s for s in said)
    assert "**checkpoint sha256 (bench/checkpoint_id.py): MIXED**" in res["report"]["markdown"]


def test_a_rebuild_during_the_sweep_stops_it_before_the_next_arm(tmp_path, monkeypatch):
    ck, dr = _checkpoint(tmp_path / "t"), _checkpoint(tmp_path / "d")
    from adaspec.bench.server import ServerProcess

    started = ServerProcess.start

    def start_then_rebuild(self):  # the first arm's server starts, then the weights change on disk
        started(self)
        _rewrite(ck / "model.safetensors", b"\x09" * 64)

    monkeypatch.setattr(ServerProcess, "start", start_then_rebuild)
    with pytest.raises(AdaspecError, match="the weights changed since the sweep started: model_sha256"):
        _started(tmp_path, monkeypatch, tmp_path / "s", ck, dr)
    assert {p.name for p in (tmp_path / "s" / "points").glob("*.json")} == {"none_c1_r0.json", "none_c2_r0.json"}


def test_merge_pools_repeats_in_order_and_records_sources(tmp_path, monkeypatch):
    ck, dr = _checkpoint(tmp_path / "target"), _checkpoint(tmp_path / "drafter", b"\x05" * 16)
    _started(tmp_path, monkeypatch, tmp_path / "a", ck, dr, arms="none", conc="1", repeats=11)
    _started(tmp_path, monkeypatch, tmp_path / "b", ck, dr, arms="none", conc="1", repeats=1)
    assert main(["bench", "merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "m")]) == 0
    m = tmp_path / "m"
    assert sorted(p.name for p in (m / "points").glob("*.json")) == sorted(f"none_c1_r{r}.json" for r in range(12))
    for r in range(12):  # source order, repeats numerically (r10 after r9, not after r1)
        d = json.loads((m / "points" / f"none_c1_r{r}.json").read_text())
        want = {"sweep": str(tmp_path / "a"), "repeat": r} if r < 11 else {"sweep": str(tmp_path / "b"), "repeat": 0}
        assert d["repeat"] == r and d["merged_from"] == want
    man = json.loads((m / "manifest.json").read_text())
    assert [s["sweep"] for s in man["merged_from"]] == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert [r["sweep"] for r in man["runs"]] == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert man["repeats"] == 12 and man["concurrency"] == [1] and [a["name"] for a in man["arms"]] == ["none"]
    assert "checkpoints_assumed_same" not in man
    assert (m / "logs" / "0-a" / "none.log").is_file() and (m / "logs" / "1-b" / "none.log").is_file()
    md = (m / "report.md").read_text()
    assert "**merged from 2 sweeps**" in md and "repeats: up to 12" in md and "MIXED" not in md
    assert not [p for p in tmp_path.iterdir() if ".merging-" in p.name]  # the work folder is gone


def test_merge_of_moving_load_sweeps(tmp_path, monkeypatch):
    ck, dr = _checkpoint(tmp_path / "target"), _checkpoint(tmp_path / "drafter", b"\x05" * 16)
    for s in ("a", "b"):
        _started(tmp_path, monkeypatch, tmp_path / s, ck, dr, "--load-phases", "1x2,2x4", arms="none,fixed:3", conc=None)
    res = merge_sweeps([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    assert sorted(p.name for p in (tmp_path / "m" / "points").glob("*.json")) == \
        [f"{a}_phases_r{r}.json" for a in ("fixed-3", "none") for r in (0, 1)]
    assert res["manifest"]["concurrency"] == [1, 2]  # the phases' caps, as the sources recorded them
    md = res["report"]["markdown"]
    assert "## Whole run (mean ± sample std over 2 repeats)" in md and "merged from 2 sweeps" in md
    with pytest.raises(AdaspecError, match="they measured load phases only"):
        merge_sweeps([tmp_path / "a", tmp_path / "b"], tmp_path / "m2", concurrency=[1])


def test_merge_refusals(tmp_path, monkeypatch):
    ck, dr = _checkpoint(tmp_path / "target"), _checkpoint(tmp_path / "drafter", b"\x05" * 16)
    _started(tmp_path, monkeypatch, tmp_path / "a", ck, dr)
    _started(tmp_path, monkeypatch, tmp_path / "a2", ck, dr)
    _started(tmp_path, monkeypatch, tmp_path / "t0", ck, dr, "--temperature", "0")
    _started(tmp_path, monkeypatch, tmp_path / "one_arm", ck, dr, arms="none")
    _started(tmp_path, monkeypatch, tmp_path / "args", ck, dr, "--server-arg=--max-num-seqs=2")
    monkeypatch.setenv("ADASPEC_COMMIT", "another-commit")
    _started(tmp_path, monkeypatch, tmp_path / "commit", ck, dr)
    monkeypatch.setenv("ADASPEC_COMMIT", "0123abc")
    _rewrite(ck / "model.safetensors", b"\x04" * 64)
    _started(tmp_path, monkeypatch, tmp_path / "rebuilt", ck, dr)
    shutil.copytree(tmp_path / "a", tmp_path / "a_copy")

    def refused(*sources, **kw):
        with pytest.raises(AdaspecError) as e:
            merge_sweeps([tmp_path / s for s in sources], tmp_path / "out", report=False, **kw)
        assert not (tmp_path / "out" / "manifest.json").exists()
        return str(e.value)

    assert "differing: temperature" in refused("a", "t0")
    assert "differing: server args of arm fixed:3, server args of arm none" in refused("a", "args")
    assert "differing: engine commit" in refused("a", "commit")
    assert "checkpoint sha256" in refused("a", "rebuilt")  # same path, other weights
    msg = refused("a", "one_arm")
    assert "only in some: " in msg and "fixed:3 C=1, fixed:3 C=2" in msg and "arms with a common cell: none" in msg
    assert "hold the same measurement" in refused("a", "a_copy")
    assert "given twice" in refused("a", "a")
    assert "at least two" in refused("a")
    assert "leave it out" in refused("a", "a2", assume_same_checkpoints="because")
    assert "--arms: no source measured fixed:7" in refused("a", "one_arm", arms=["none", "fixed:7"])
    assert "--concurrency: no source measured [64]" in refused("a", "one_arm", arms=["none"], concurrency=[64])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("")
    assert "not empty" in refused("a", "a2")
    (tmp_path / "out" / "x").unlink()
    (tmp_path / "out").rmdir()
    (tmp_path / "out").write_text("")
    assert "is not a directory" in refused("a", "a2")
    (tmp_path / "out").unlink()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "manifest.json").write_text("{")
    assert "is not valid JSON" in refused("a", "broken")
    assert "has no manifest.json" in refused("a", "a/points")

    # what the refusals point to works: a subset of arms or of concurrencies
    res = merge_sweeps([tmp_path / "a", tmp_path / "one_arm"], tmp_path / "sub", arms=["none"])
    assert res["points"] == 4 and [a["name"] for a in res["manifest"]["arms"]] == ["none"]
    res = merge_sweeps([tmp_path / "a", tmp_path / "a2"], tmp_path / "c1", concurrency=[1])
    assert res["points"] == 4 and res["manifest"]["concurrency"] == [1]
    assert "is itself a merge" in refused("sub", "a")  # its repeats would count twice

    # a drafter the sweep could not fingerprint
    _started(tmp_path, monkeypatch, tmp_path / "nd1", ck, "served-drafter")
    _started(tmp_path, monkeypatch, tmp_path / "nd2", ck, "served-drafter")
    assert "the drafter's (no sha256 recorded for it)" in refused("nd1", "nd2")
    assert merge_sweeps([tmp_path / "nd1", tmp_path / "nd2"], tmp_path / "nd", arms=["none"])["points"] == 4

    # points from before points recorded their conditions cannot be checked
    p = tmp_path / "a2" / "points" / "none_c1_r0.json"
    d = json.loads(p.read_text())
    del d["conditions"]
    p.write_text(json.dumps(d))
    assert "records no conditions" in refused("a", "a2")


def test_external_servers_need_a_stated_assumption(tmp_path):
    ck = _checkpoint(tmp_path / "target")
    with FakeServer({}, default=FAST) as srv:
        assert _external(srv, tmp_path / "a", ck) == 0
        assert _external(srv, tmp_path / "b", ck) == 0
    with pytest.raises(AdaspecError, match=r"servers at a --base-url \(none\): the sweep cannot see what they serve"):
        merge_sweeps([tmp_path / "a", tmp_path / "b"], tmp_path / "m", report=False)
    res = merge_sweeps([tmp_path / "a", tmp_path / "b"], tmp_path / "m",
                       assume_same_checkpoints="one server, not restarted between the sweeps")
    assert res["manifest"]["checkpoints_assumed_same"] == "one server, not restarted between the sweeps"
    assert "assumed the same by whoever merged them:** one server, not restarted" in res["report"]["markdown"]


def test_merge_refuses_uncommitted_engine_code_unless_assumed_the_same(tmp_path, monkeypatch):
    ck, dr = _checkpoint(tmp_path / "target"), _checkpoint(tmp_path / "drafter", b"\x05" * 16)
    monkeypatch.setenv("ADASPEC_COMMIT", "0123abc-dirty (unverified)")
    for s in ("a", "b"):
        _started(tmp_path, monkeypatch, tmp_path / s, ck, dr, arms="none", conc="1", repeats=1)
    with pytest.raises(AdaspecError, match="had uncommitted changes"):
        merge_sweeps([tmp_path / "a", tmp_path / "b"], tmp_path / "m")
    assert not (tmp_path / "m").exists()
    res = merge_sweeps([tmp_path / "a", tmp_path / "b"], tmp_path / "m", assume_same_code="one tree, two runs")
    assert res["manifest"]["code_assumed_same"] == "one tree, two runs"
    assert "uncommitted changes; assumed the same by whoever merged them:** one tree, two runs" in \
        res["report"]["markdown"]
    monkeypatch.setenv("ADASPEC_COMMIT", "0123abc")
    for s in ("c", "d"):
        _started(tmp_path, monkeypatch, tmp_path / s, ck, dr, arms="none", conc="1", repeats=1)
    with pytest.raises(AdaspecError, match="record a clean commit"):
        merge_sweeps([tmp_path / "c", tmp_path / "d"], tmp_path / "m2", assume_same_code="why not")
