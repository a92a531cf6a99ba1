"""`bench sweep` when things go wrong: a server that dies during a point, a sweep interrupted
between points, arms whose file names collide, concurrencies added on resume, and code that
changes between arms. The arms' servers are in-process fakes (no subprocess), so each test is fast."""
import json
from pathlib import Path

import pytest

from adaspec.bench import server as server_mod
from adaspec.bench.cli import sweep_config_from_args
from adaspec.bench.report import write_report
from adaspec.bench.sweep import run_sweep
from adaspec.cli import build_parser
from adaspec.errors import AdaspecError

from .fakeserver import FakeServer, Script

FAST = Script(chunks=[(0.0, "ab", 2), (0.0, "c", 1)], prompt_tokens=4)


class FakeProc:
    def __init__(self, owner):
        self.owner = owner
        self.returncode = None

    def poll(self):
        # "dies" once it has answered `dies_after` completions requests
        if self.owner.dies_after is not None and len(self.owner.fake.requests) >= self.owner.dies_after:
            self.returncode = -9
        return self.returncode


class FakeServerProcess:
    """Stands in for adaspec.bench.server.ServerProcess: an in-process fake OpenAI server."""
    dies_after = None  # set per test: the server counts as dead after this many requests
    started: list = []
    on_start = None  # called with the arm's log path when its server starts (tests hook in there)

    def __init__(self, model, spec_config, log_path, extra_args=None, startup_timeout=600.0, launcher=None):
        self.model, self.spec_config, self.log_path = model, spec_config, Path(log_path)
        self.fake = FakeServer({}, default=FAST)
        self.startup_s = 0.0
        self.proc = None

    def command_line(self) -> str:
        return f"fake serve {self.model}"

    def start(self):
        if FakeServerProcess.on_start:
            FakeServerProcess.on_start(self.log_path)
        self.fake.__enter__()
        self.proc = FakeProc(self)
        FakeServerProcess.started.append(self)
        return self

    @property
    def url(self) -> str:
        return self.fake.url

    def stop(self, grace: float = 30.0) -> None:
        if self.proc is not None and self.fake._thread.is_alive():
            self.fake.__exit__()


@pytest.fixture
def fake_servers(monkeypatch):
    monkeypatch.setattr(server_mod, "ServerProcess", FakeServerProcess)
    monkeypatch.setattr(FakeServerProcess, "dies_after", None)
    monkeypatch.setattr(FakeServerProcess, "started", [])
    monkeypatch.setattr(FakeServerProcess, "on_start", None)
    return FakeServerProcess


def _cfg(out, *extra, log=None):
    argv = ["bench", "sweep", "--model", "m0", "--concurrency", "2", "--repeats", "1", "--num-prompts", "4",
            "--num-warmups", "0", "--dataset", "random", "--tokenizer", "tiny", "--output-len", "8",
            "--out", str(out), "--disable-tqdm", "--no-report", *extra]
    if "--arms" not in extra and "--base-url" not in extra:
        argv += ["--arms", "none"]
    return sweep_config_from_args(build_parser().parse_args(argv), log=log or (lambda *a: None))


def _point(out, name):
    return json.loads((Path(out) / "points" / name).read_text())


def test_a_point_during_which_the_server_died_is_incomplete_and_measured_again(tmp_path, fake_servers):
    out = tmp_path / "o"
    fake_servers.dies_after = 2  # dies after 2 of the point's 4 requests were answered (all 4 completed)
    with pytest.raises(AdaspecError, match=r"server for arm none died .* during C=2 repeat 1; its point is kept"):
        run_sweep(_cfg(out))
    p = _point(out, "none_c2_r0.json")
    assert p["completed"] == 4 and p["server_died"] is True
    assert p["complete"] is False, "a point cut short by a crash must not count as measured"
    # resume with a healthy server: the point is measured again, not skipped
    fake_servers.dies_after = None
    run_sweep(_cfg(out))
    p = _point(out, "none_c2_r0.json")
    assert p["complete"] is True and "server_died" not in p
    assert len(fake_servers.started) == 2 and len(fake_servers.started[1].fake.requests) == 4


class Interrupt(Exception):
    pass


def test_the_manifest_counts_each_point_as_it_is_written(tmp_path, fake_servers):
    """An interrupted sweep's manifest once said points_run: 0 (it was written only after each arm)."""
    out = tmp_path / "o"

    def log(msg):
        if "C=1 repeat" in msg:
            raise Interrupt  # as a Ctrl-C right after the first point
    with pytest.raises(Interrupt):
        run_sweep(_cfg(out, "--arms", "none,fixed:3", "--concurrency", "1,2", log=log))
    m = json.loads((out / "manifest.json").read_text())
    assert m["runs"][-1]["points_run"] == 1 and m["runs"][-1]["end"] is None
    assert [p.name for p in (out / "points").glob("*.json")] == ["none_c1_r0.json"]


def test_arms_whose_file_names_collide_are_refused_naming_both(tmp_path, fake_servers):
    with pytest.raises(AdaspecError, match="arms 'a:b' and 'a-b' would share the file name 'a-b'"):
        _cfg(tmp_path / "o", "--base-url", "a:b=http://127.0.0.1:9", "--base-url", "a-b=http://127.0.0.1:9")
    # across a resume: an earlier arm's files are not taken for a new arm's
    with FakeServer({}, default=FAST) as srv:
        run_sweep(_cfg(tmp_path / "o", "--base-url", f"a:b={srv.url}"))
        with pytest.raises(AdaspecError, match="arms 'a:b' and 'a-b' would share the file name 'a-b'"):
            run_sweep(_cfg(tmp_path / "o", "--base-url", f"a-b={srv.url}"))
    assert _point(tmp_path / "o", "a-b_c2_r0.json")["arm"] == "a:b"


def _jsonl(path, prompts):
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


def _jsonl_cfg(out, data, *extra, log=None):
    argv = ["--dataset", "jsonl", "--dataset-path", str(data), "--num-prompts", "2", *extra]
    return _cfg(out, *argv, log=log)


def test_a_resume_may_add_concurrencies_but_not_change_what_points_sent(tmp_path, fake_servers):
    """The README says concurrencies may be added on resume; the prompt hash covered the whole pool,
    max(num_prompts, W x the largest C), so adding one was refused ("Differing: prompts_sha256")."""
    out, data = tmp_path / "o", _jsonl(tmp_path / "p.jsonl", ["p0", "p1", "p2", "p3", "p4", "p5", "p6", "p7"])
    run_sweep(_jsonl_cfg(out, data, "--concurrency", "1,2"))
    said = []
    run_sweep(_jsonl_cfg(out, data, "--concurrency", "1,2,4", log=said.append))  # resumes: only C=4 is new
    m = json.loads((out / "manifest.json").read_text())
    assert m["runs"][-1]["points_run"] == 1 and m["runs"][-1]["points_skipped"] == 2
    assert m["concurrency"] == [1, 2, 4] and set(m["sent_prompts_sha256"]) == {"1", "2", "4"}
    p4, p2 = _point(out, "none_c4_r0.json"), _point(out, "none_c2_r0.json")
    assert p4["completed"] == 4 and p4["conditions"]["prompts_sha256"] == p2["conditions"]["prompts_sha256"]
    assert [r["prompt"] for r in fake_servers.started[1].fake.requests] == ["p0", "p1", "p2", "p3"]
    md = write_report(out)["markdown"]
    assert "MIXED" not in md and "different settings" not in md

    # prompts that an earlier point sent and this run would send otherwise: refused, naming the concurrency
    _jsonl(data, ["p0", "p1", "p2", "CHANGED", "p4", "p5", "p6", "p7"])
    with pytest.raises(AdaspecError) as e:
        run_sweep(_jsonl_cfg(out, data, "--concurrency", "1"))  # C=4 not rerun, but its points are in --out
    msg = str(e.value)
    assert "prompts sent at C=4 (the prompt texts)" in msg
    assert "C=1" not in msg and "C=2" not in msg and "prompts_sha256" not in msg  # the first two are the same
    _jsonl(data, ["p0", "p1", "p2", "p3", "p4", "p5", "p6", "p7"])
    run_sweep(_jsonl_cfg(out, data, "--concurrency", "1"))

    # points of one concurrency that sent different prompts are never reported as alike
    path = out / "points" / "none_c2_r0.json"
    p = json.loads(path.read_text())
    p["conditions"]["sent_prompts_sha256"] = "0" * 64
    path.write_text(json.dumps(p))
    run_sweep(_jsonl_cfg(out, data, "--concurrency", "2", "--repeats", "2"))
    md = write_report(out)["markdown"]
    assert "- **prompts sent at C=2 (sha256): MIXED**" in md
    assert "measured under different settings (prompts sent at C=2)" in md


def test_a_sweep_from_before_resumes_with_its_whole_pool_hashed(tmp_path, fake_servers):
    """A manifest from before hashed the whole pool (here max(2, 4) = 4 prompts) and no per-point
    prompts: it resumes, adding a concurrency, and its new points hash the same prompts."""
    from adaspec.bench.sweep import prompts_sha256

    out, data = tmp_path / "o", _jsonl(tmp_path / "p.jsonl", ["p0", "p1", "p2", "p3", "p4", "p5", "p6", "p7"])
    run_sweep(_jsonl_cfg(out, data, "--concurrency", "1,4"))
    whole_pool = prompts_sha256(["p0", "p1", "p2", "p3"])
    for f in [out / "manifest.json", *(out / "points").glob("*.json")]:
        d = json.loads(f.read_text())
        c = d.get("conditions") or d
        for k in ("prompts_sha256_count", "sent_prompts_sha256"):
            c.pop(k)
        c["prompts_sha256"] = whole_pool
        f.write_text(json.dumps(d))
    run_sweep(_jsonl_cfg(out, data, "--concurrency", "1,4,8"))
    p8 = _point(out, "none_c8_r0.json")
    assert p8["conditions"]["prompts_sha256"] == whole_pool and p8["conditions"]["prompts_sha256_count"] == 4
    assert "MIXED" not in write_report(out)["markdown"]
    # another pool at the old concurrencies is still refused
    _jsonl(data, ["p0", "p1", "p2", "CHANGED", "p4", "p5", "p6", "p7"])
    with pytest.raises(AdaspecError, match=r"prompts_sha256 \(the prompt texts\)"):
        run_sweep(_jsonl_cfg(out, data, "--concurrency", "1"))


def test_sweeps_of_other_concurrencies_merge_on_their_common_cells(tmp_path, fake_servers, monkeypatch):
    from adaspec.bench.merge import merge_sweeps

    monkeypatch.setenv("ADASPEC_COMMIT", "abc123")
    data = _jsonl(tmp_path / "p.jsonl", ["p0", "p1", "p2", "p3"])
    run_sweep(_jsonl_cfg(tmp_path / "a", data, "--concurrency", "1,2"))
    run_sweep(_jsonl_cfg(tmp_path / "b", data, "--concurrency", "1,4"))
    res = merge_sweeps([tmp_path / "a", tmp_path / "b"], tmp_path / "m", concurrency=[1], report=False,
                       assume_same_checkpoints="test: fake servers")
    assert res["points"] == 2


def test_each_point_records_the_commit_its_arms_server_started_on(tmp_path, fake_servers, monkeypatch):
    """A commit made during a sweep reaches the arms started after it: their points must not claim
    the commit read at the sweep's start (the report and manifest say the points ran different code)."""
    from adaspec.bench import conditions

    commits = iter(["aaa", "aaa", "bbb"])  # the sweep's start, arm none's server, arm fixed:3's server
    monkeypatch.setattr(conditions, "engine_commit", lambda root=None: next(commits))
    said = []
    run_sweep(_cfg(tmp_path / "o", "--arms", "none,fixed:3", log=said.append))
    assert _point(tmp_path / "o", "none_c2_r0.json")["conditions"]["engine_commit"] == "aaa"
    assert _point(tmp_path / "o", "fixed-3_c2_r0.json")["conditions"]["engine_commit"] == "bbb"
    m = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert m["engine_commit"] == "aaa" and m["engine_commits"] == ["aaa", "bbb"]
    assert any("the engine commit changed during the sweep ('aaa' -> 'bbb')" in s for s in said)
    md = write_report(tmp_path / "o")["markdown"]
    assert "- **engine commit: MIXED**" in md and "measured under different settings (engine commit)" in md
