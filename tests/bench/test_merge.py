"""Checkpoint ids in a sweep's manifest and points (bench/checkpoint_id.py), the resume that refuses
other weights at the same path, and `adaspec bench merge` (bench/merge.py): repeats pooled only from
sources measured under the same conditions and cells."""
import json
import os

import pytest

from adaspec.bench.checkpoint_id import checkpoint_sha256, checkpoints
from adaspec.bench.merge import merge_sweeps
from adaspec.cli import main
from adaspec.errors import AdaspecError

from .fakeserver import FakeServer, Script

FAST = Script(chunks=[(0.01, "ab", 2), (0.01, "c", 1)], prompt_tokens=4)


def _checkpoint(d, weights=b"\x01" * 64):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text('{"hidden_size": 8}')
    (d / "model.safetensors").write_bytes(weights)
    (d / "MODEL_CARD.md").write_text("card")
    return d


def _rewrite(path, data: bytes):
    st = path.stat()
    path.write_bytes(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new file: the cache keys on mtime too


def test_checkpoint_sha256_follows_the_weights_not_the_card(tmp_path):
    d = _checkpoint(tmp_path / "ck")
    first = checkpoint_sha256(d)
    assert len(first) == 64 and checkpoint_sha256(str(d)) == first
    _rewrite(d / "MODEL_CARD.md", b"another card")
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


def _sweep(server, out, model, *extra, arms=("none",)):
    argv = ["bench", "sweep", "--model", str(model), "--concurrency", "1,2", "--repeats", "1", "--num-prompts", "2",
            "--num-warmups", "0", "--dataset", "random", "--tokenizer", "tiny", "--output-len", "4", "--out", str(out),
            "--disable-tqdm", *extra]
    for a in arms:
        argv += ["--base-url", f"{a}={server.url}"]
    return main(argv)


def test_resume_refuses_other_weights_at_the_same_path(tmp_path, capsys):
    ck = _checkpoint(tmp_path / "pair" / "target")
    out = tmp_path / "s"
    with FakeServer({}, default=FAST) as srv:
        assert _sweep(srv, out, ck) == 0
        m = json.loads((out / "manifest.json").read_text())
        assert m["checkpoints"] == {"model_sha256": checkpoint_sha256(ck), "drafter_sha256": None}
        p = json.loads((out / "points" / "none_c1_r0.json").read_text())
        assert p["conditions"]["checkpoints"] == m["checkpoints"]
        assert "checkpoint sha256" in (out / "report.md").read_text()
        # a rebuild writes other weights to the same path: resuming would mix two builds
        (out / "points" / "none_c2_r0.json").unlink()
        _rewrite(ck / "model.safetensors", b"\x03" * 64)
        capsys.readouterr()
        assert _sweep(srv, out, ck) == 2
    err = capsys.readouterr().err
    assert "model_sha256 (the weights at --model)" in err and "a resumed sweep must use the same ones" in err


def test_merge_pools_repeats_and_records_sources(tmp_path, capsys):
    ck = _checkpoint(tmp_path / "target")
    with FakeServer({}, default=FAST) as srv:
        assert _sweep(srv, tmp_path / "a", ck, arms=("none", "fixed:3")) == 0
        assert _sweep(srv, tmp_path / "b", ck, arms=("none", "fixed:3")) == 0
    capsys.readouterr()
    assert main(["bench", "merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "m")]) == 0
    m = tmp_path / "m"
    names = sorted(p.name for p in (m / "points").glob("*.json"))
    assert names == [f"{arm}_c{c}_r{r}.json" for arm in ("fixed-3", "none") for c in (1, 2) for r in (0, 1)]
    p = json.loads((m / "points" / "none_c2_r1.json").read_text())
    assert p["repeat"] == 1 and p["merged_from"] == {"sweep": str(tmp_path / "b"), "repeat": 0}
    man = json.loads((m / "manifest.json").read_text())
    assert [s["sweep"] for s in man["merged_from"]] == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert [r["sweep"] for r in man["runs"]] == [str(tmp_path / "a"), str(tmp_path / "b")]
    assert man["repeats"] == 2 and man["concurrency"] == [1, 2] and [a["name"] for a in man["arms"]] == ["none", "fixed:3"]
    assert "checkpoints_assumed_same" not in man
    md = (m / "report.md").read_text()
    assert "**merged from 2 sweeps**" in md and "repeats: up to 2" in md and "MIXED" not in md
    assert (m / "logs").is_dir() or not (tmp_path / "a" / "logs").is_dir()


def test_merge_refusals(tmp_path, capsys):
    ck = _checkpoint(tmp_path / "target")
    with FakeServer({}, default=FAST) as srv:
        assert _sweep(srv, tmp_path / "a", ck, arms=("none", "fixed:3")) == 0
        assert _sweep(srv, tmp_path / "t0", ck, "--temperature", "0", arms=("none", "fixed:3")) == 0
        assert _sweep(srv, tmp_path / "one_arm", ck) == 0
        assert _sweep(srv, tmp_path / "name_a", "served-name") == 0
        assert _sweep(srv, tmp_path / "name_b", "served-name") == 0
        _rewrite(ck / "model.safetensors", b"\x04" * 64)
        assert _sweep(srv, tmp_path / "rebuilt", ck, arms=("none", "fixed:3")) == 0

    def refused(*sources, **kw):
        with pytest.raises(AdaspecError) as e:
            merge_sweeps([tmp_path / s for s in sources], tmp_path / "out", report=False, **kw)
        assert not (tmp_path / "out" / "manifest.json").exists()
        return str(e.value)

    assert "differing: temperature" in refused("a", "t0")
    assert "checkpoint sha256" in refused("a", "rebuilt")  # same path, other weights
    msg = refused("a", "one_arm")
    assert "fixed:3 C=1" in msg and "--arms" in msg and "arms with a common cell: none" in msg
    assert "given twice" in refused("a", "a")
    assert "at least two" in refused("a")
    assert "no checkpoint sha256" in refused("name_a", "name_b")
    assert "leave it out" in refused("a", "one_arm", arms=["none"], assume_same_checkpoints="because")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("")
    assert "not empty" in refused("a", "one_arm", arms=["none"])
    (tmp_path / "out" / "x").unlink()
    assert "--arms: no source measured fixed:7" in refused("a", "one_arm", arms=["none", "fixed:7"])
    assert "--concurrency: no source measured [64]" in refused("a", "one_arm", arms=["none"], concurrency=[64])

    # what the refusals point to works: a subset of arms, or an assumption stated with its reason
    res = merge_sweeps([tmp_path / "a", tmp_path / "one_arm"], tmp_path / "sub", arms=["none"])
    assert res["points"] == 4 and [a["name"] for a in res["manifest"]["arms"]] == ["none"]
    res = merge_sweeps([tmp_path / "a", tmp_path / "one_arm"], tmp_path / "c1", arms=["none"], concurrency=[1])
    assert res["points"] == 2 and res["manifest"]["concurrency"] == [1]
    res = merge_sweeps([tmp_path / "name_a", tmp_path / "name_b"], tmp_path / "named",
                       assume_same_checkpoints="one server, not restarted between the sweeps")
    assert res["manifest"]["checkpoints_assumed_same"] == "one server, not restarted between the sweeps"
    assert "assumed the same by whoever merged them:** one server, not restarted" in res["report"]["markdown"]

    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "manifest.json").write_text("{")
    assert "is not valid JSON" in refused("a", "broken")
    assert "has no manifest.json" in refused("a", "sub/points")

    # points from before points recorded their conditions cannot be checked
    p = tmp_path / "name_b" / "points" / "none_c1_r0.json"
    d = json.loads(p.read_text())
    del d["conditions"]
    p.write_text(json.dumps(d))
    assert "records no conditions" in refused("name_a", "name_b", assume_same_checkpoints="x")
