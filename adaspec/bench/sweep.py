"""`adaspec bench sweep`: every arm x concurrency x repeat, one point file each, resumable.

For each arm it starts one `adaspec serve` (or uses the --base-url the user gave), runs the
points, stops the server. A point file exists only once its run finished (atomic rename), so
a rerun with the same --out continues where the last one stopped.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

from adaspec.bench import checkpoint_id, conditions, point_conditions
from adaspec.bench.arms import Arm, external_arm, refuse_slug_collisions
from adaspec.bench.phases import format_phases
from adaspec.bench.runner import BenchConfig, BenchError, run_benchmark, write_json_atomic

# Every setting that changes what a point measures: a resumed sweep must match them all, and
# each point records them (with its arm's server settings, hardware and engine commit).
SETTINGS = ("model", "drafter", "output_len", "random_range_ratio", "ignore_eos", "temperature", "endpoint", "prompts",
            "prompts_sha256", "num_prompts", "prompts_per_concurrency", "num_warmups", "seed", "load_phases")
# What a manifest written before a setting existed meant by it (so such a sweep still resumes).
SETTING_DEFAULTS = point_conditions.DEFAULTS
# Per arm: what its server was started with.
ARM_SETTINGS = ("speculative_config", "server_args", "base_url")
# What a sweep writes into --out (and --force-new removes).
OUTPUTS = ("points", "logs", "manifest.json", "report.md", "report.html", "frontier.png")


@dataclass
class SweepConfig:
    out: Path
    model: str | None  # None only with base_urls: each server is asked what it serves
    arms: list[Arm]
    concurrency: list[int]  # with load_phases: the phases' caps (for the record only)
    prompts: list[str]  # the pool; each point takes max(num_prompts, prompts_per_concurrency * C), cycling
    prompts_desc: dict
    num_prompts: int
    # waves of C prompts per point at least: one wave at a high C lasts about one request's life, so
    # its ramp up and down outweigh its steady state (H200 run 17: through the server at C = 256, one
    # wave of 64-token requests made 22k tok/s where the offline sweep's 4 waves made 51k)
    prompts_per_concurrency: int = 1
    repeats: int = 3
    drafter: str | None = None
    base_urls: dict[str, str] = field(default_factory=dict)  # arm name -> URL of a server we did not start
    output_len: int = 128
    random_range_ratio: float = 0.0  # each request's max_tokens spread over [L(1 - r), L(1 + r)] (lengths.py)
    ignore_eos: bool = False
    temperature: float = 1.0
    endpoint: str = "completions"
    num_warmups: int = 2
    api_key: str | None = None
    seed: int = 0
    server_args: list[str] = field(default_factory=list)
    spec_extra: dict = field(default_factory=dict)  # merged into every speculative arm's config
    startup_timeout: float = 600.0
    force_new: bool = False  # discard what an earlier sweep left in `out` instead of resuming
    progress: bool = True
    report: bool = True
    log: callable = print
    launcher: list[str] | None = None  # replaces `python -m adaspec.cli` (tests)
    # A moving load (phases.py): each arm runs this schedule once per repeat, one point each,
    # instead of one point per concurrency; num_prompts is then the schedule's request count.
    load_phases: list | None = None
    # How many prompts of the sequence `prompts_sha256` covers: None, the first num_prompts (what
    # every point sends, whatever the concurrencies). A sweep from before hashed its whole pool,
    # max(num_prompts, W x its largest C); resuming one keeps that count (run_sweep sets it).
    prompts_hashed: int | None = None


# The "concurrency" of a moving-load point: its schedule, not one number.
PHASED = None


def point_path(out: Path, arm: Arm, c: int | None, r: int) -> Path:
    return out / "points" / (f"{arm.slug}_phases_r{r}.json" if c is PHASED else f"{arm.slug}_c{c}_r{r}.json")


def grid(cfg: SweepConfig) -> list[tuple[int | None, int]]:
    """(concurrency, repeat) of every point per arm; concurrency PHASED for a moving load."""
    concs = [PHASED] if cfg.load_phases else cfg.concurrency
    return [(c, r) for c in concs for r in range(cfg.repeats)]


def point_done(path: Path) -> bool:
    try:
        return bool(json.loads(path.read_text()).get("complete"))
    except (OSError, json.JSONDecodeError):
        return False


def prompts_sequence(cfg: SweepConfig, n: int) -> list[str]:
    """The first n prompts of the sweep's sequence (the pool, cycled). Every point sends a prefix of
    it, and the datasets make it prefix-stable (a larger pool extends a smaller one)."""
    return [cfg.prompts[i % len(cfg.prompts)] for i in range(n)]


def prompts_for(cfg: SweepConfig, c: int | None) -> list[str]:
    # At least C prompts, or the point never reaches its concurrency; a moving load sends one per request.
    n = cfg.num_prompts if c is PHASED else max(cfg.num_prompts, cfg.prompts_per_concurrency * c)
    return prompts_sequence(cfg, n)


def prompts_sha256(prompts: list[str]) -> str:
    return hashlib.sha256("\x1e".join(prompts).encode()).hexdigest()


def sent_key(c: int | None) -> str:
    """A point's concurrency as the manifest's `sent_prompts_sha256` keys it."""
    return "phases" if c is PHASED else str(c)


def sent_prompts(cfg: SweepConfig, concurrencies) -> dict[str, str]:
    """sha256 of the prompts a point at each concurrency sends (`sent_key` -> hash)."""
    return {sent_key(c): prompts_sha256(prompts_for(cfg, c)) for c in concurrencies}


def old_pool_size(old: dict) -> int:
    """How many prompts a manifest from before `prompts_sha256_count` hashed: its whole pool."""
    n = int(old.get("num_prompts") or 0)
    if old.get("load_phases"):
        return n
    w = int(old.get("prompts_per_concurrency", SETTING_DEFAULTS.get("prompts_per_concurrency", 1)))
    return max([n] + [w * int(c) for c in old.get("concurrency") or []])


def arm_record(cfg: SweepConfig, arm: Arm) -> dict:
    rec = {"name": arm.name, "kind": arm.kind, "k": arm.k}
    if arm.name in cfg.base_urls:
        rec["base_url"] = cfg.base_urls[arm.name]
        # The sweep cannot see how an external server was configured; it says so.
        rec["speculative_config"] = "set by the external server"
    else:
        rec["speculative_config"] = arm.speculative_config(cfg.drafter, cfg.temperature, cfg.spec_extra)
        rec["server_args"] = list(cfg.server_args)
    return rec


def settings(cfg: SweepConfig) -> dict:
    """The SETTINGS of this sweep, as stored in the manifest and in every point."""
    return {
        "model": cfg.model,
        "drafter": cfg.drafter,
        "output_len": cfg.output_len,
        "random_range_ratio": cfg.random_range_ratio,
        "ignore_eos": cfg.ignore_eos,
        "temperature": cfg.temperature,
        "endpoint": cfg.endpoint,
        "prompts": cfg.prompts_desc,
        # the prompts every point sends (the first num_prompts), so adding a concurrency changes nothing here;
        # what each point sent beyond them is its own `sent_prompts_sha256`
        "prompts_sha256": prompts_sha256(prompts_sequence(cfg, cfg.prompts_hashed or cfg.num_prompts)),
        "prompts_sha256_count": cfg.prompts_hashed or cfg.num_prompts,
        "num_prompts": cfg.num_prompts,
        "prompts_per_concurrency": cfg.prompts_per_concurrency,
        "num_warmups": cfg.num_warmups,
        "seed": cfg.seed,
        "load_phases": format_phases(cfg.load_phases) if cfg.load_phases else None,
    }


def _flag(key: str) -> str:
    return {"prompts": "--dataset/--dataset-path/--random-input-len", "prompts_sha256": "the prompt texts",
            "sent_prompts_sha256": "the prompt texts",
            "speculative_config": "--drafter/--temperature/--speculative-config-extra",
            "server_args": "--server-arg", "base_url": "--base-url", "num_prompts": "--num-prompts/--load-phases"}.get(key, "--" + key.replace("_", "-"))


def differences(cfg: SweepConfig, old: dict) -> list[str]:
    """Each setting where `old` (a manifest) differs from this sweep: 'name (flag): old -> new'."""
    new = settings(cfg)
    diff = [f"{k} ({_flag(k)}): {old.get(k, SETTING_DEFAULTS.get(k))!r} -> {new[k]!r}" for k in SETTINGS
            if old.get(k, SETTING_DEFAULTS.get(k)) != new[k]]
    # what the earlier points sent, concurrency by concurrency (the pool covers them: cli sizes it so)
    for key, was in (old.get("sent_prompts_sha256") or {}).items():
        now = prompts_sha256(prompts_for(cfg, PHASED if key == "phases" else int(key)))
        if now != was:
            diff.append(f"prompts sent at {'the load phases' if key == 'phases' else f'C={key}'} "
                        f"({_flag('sent_prompts_sha256')}): {was!r} -> {now!r}")
    prev_arms = {a["name"]: a for a in old.get("arms", [])}
    for arm in cfg.arms:
        prev, rec = prev_arms.get(arm.name), arm_record(cfg, arm)
        if prev is None:
            continue  # a new arm: nothing of it measured yet
        diff += [f"arm {arm.name} {k} ({_flag(k)}): {prev.get(k)!r} -> {rec.get(k)!r}"
                 for k in ARM_SETTINGS if prev.get(k) != rec.get(k)]
    return diff


def sweep_checkpoints(cfg: SweepConfig) -> dict:
    """The ids of the weights the sweep's own servers load: the model, and the drafter its speculative
    configs name (--speculative-config-extra's "model" wins, as in Arm.speculative_config). A server
    at a --base-url is not covered: the sweep cannot see what it serves (the merge asks about those)."""
    return checkpoint_id.checkpoints(cfg.model, (cfg.spec_extra or {}).get("model") or cfg.drafter)


def checkpoint_differences(old: dict | None, new: dict, log=print) -> list[str]:
    """The checkpoint ids an earlier sweep recorded that differ from this one's (the same path can
    hold another build). A sweep from before ids were recorded cannot be checked: it says so."""
    if old is None:
        if any(new.values()):
            log("note: the earlier points recorded no checkpoint sha256, so whether they measured the same "
                "weights cannot be checked; the report will mark the ids as mixed")
        return []
    return [f"{k} (the weights at --{k.split('_')[0]}): {old.get(k)} -> {new[k]}" for k in new if old.get(k) != new[k]]


def start_over(out: Path) -> None:
    """Remove what an earlier sweep wrote in `out` (nothing else there)."""
    import shutil

    for name in OUTPUTS:
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)


def build_manifest(cfg: SweepConfig, old: dict | None) -> dict:
    m = settings(cfg)
    m["num_prompts_rule"] = ("each point runs the load phases, num_prompts requests in all" if cfg.load_phases
                             else "each point sends max(num_prompts, concurrency) prompts"
                             if cfg.prompts_per_concurrency == 1 else
                             "each point sends max(num_prompts, prompts_per_concurrency x concurrency) prompts")
    m["hardware"] = conditions.hardware()
    m["engine_commit"] = conditions.engine_commit()
    m["checkpoints"] = sweep_checkpoints(cfg)
    if old:
        diff = differences(cfg, old) + checkpoint_differences(old.get("checkpoints"), m["checkpoints"], cfg.log)
        if diff:
            raise BenchError(
                f"{cfg.out} holds points measured with other settings; a resumed sweep must use the same ones. "
                f"Differing: {'; '.join(diff)}. Rerun with the earlier settings to resume, or start over with "
                "--force-new (discards the earlier points) or a new --out directory"
            )
    for k in ("engine_commit", "hardware"):
        if old and old.get(k) != m[k]:
            # Not refused (the code or machine may change between sessions), but each point records
            # its own, and the report marks the mixture.
            cfg.log(f"note: {k} differs from the earlier points' ({old.get(k)!r} -> {m[k]!r}); "
                    "the report will mark it as mixed")
    arms = {a["name"]: a for a in (old or {}).get("arms", [])}
    for arm in cfg.arms:
        arms[arm.name] = arm_record(cfg, arm)
    m["arms"] = list(arms.values())
    m["concurrency"] = sorted(set((old or {}).get("concurrency", [])) | set(cfg.concurrency))
    m["sent_prompts_sha256"] = {**((old or {}).get("sent_prompts_sha256") or {}),
                                **sent_prompts(cfg, [c for c, _ in grid(cfg)])}
    m["repeats"] = max((old or {}).get("repeats", 0), cfg.repeats)
    # every engine commit the directory's points were measured with (each point records its own,
    # read when its arm's server started): more than one means its points ran different code
    m["engine_commits"] = list(dict.fromkeys(((old or {}).get("engine_commits") or
                                              ([old.get("engine_commit")] if old else [])) + [m["engine_commit"]]))
    m["start_time"] = (old or {}).get("start_time") or conditions.now_iso()
    m["end_time"] = None
    m["runs"] = (old or {}).get("runs", [])
    return m


def _run_point(cfg: SweepConfig, arm: Arm, url: str, c: int, r: int, path: Path, machine: dict,
               server_alive=None) -> dict:
    """Runs one point and writes its file. `server_alive` (the sweep's own server): a point during
    which the server died is written incomplete (`server_died`), so a resume measures it again."""
    bc = BenchConfig(
        base_url=url, model=cfg.model or None, prompts=prompts_for(cfg, c),
        max_concurrency=c, load_phases=cfg.load_phases if c is PHASED else None,
        output_len=cfg.output_len, random_range_ratio=cfg.random_range_ratio, ignore_eos=cfg.ignore_eos,
        temperature=cfg.temperature, num_warmups=cfg.num_warmups, endpoint=cfg.endpoint,
        api_key=cfg.api_key, seed=cfg.seed + 1000 * r, label=f"{arm.name} {'phases' if c is PHASED else f'C={c}'} r={r}",
        progress=cfg.progress,
        extra={"arm": arm.name, "concurrency": c, "repeat": r},
    )
    res = run_benchmark(bc)
    # A point where nothing completed says nothing about the arm, and one during which the server
    # died measured a crash (its requests cut short, or served by a dying process): keep either for
    # inspection but not as done, so a rerun measures it again.
    died = server_alive is not None and not server_alive()
    res["complete"] = res["completed"] > 0 and not died
    if died:
        res["server_died"] = True
    # The conditions this point was measured under, with the point: the report reads them from
    # here, so a directory never claims settings a point was not measured with.
    res["conditions"] = {**settings(cfg), "sent_prompts_sha256": prompts_sha256(bc.prompts),
                         "arm": arm_record(cfg, arm), **machine}
    write_json_atomic(str(path), res)
    return res


class SweepStopped(BenchError):
    """SIGTERM arrived (e.g. `timeout` ending a sweep that ran out of time)."""


@contextlib.contextmanager
def sigterm_stops_sweep():
    """SIGTERM raises SweepStopped, so the `finally` blocks stop the arm's server (started in a
    session of its own, it would outlive the sweep) and every finished point stays on disk."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SweepStopped("stopped by SIGTERM; the points measured so far are kept: rerun the same command to "
                           "resume, or `adaspec bench report` them")

    prev = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, prev)


def run_sweep(cfg: SweepConfig) -> dict:
    with sigterm_stops_sweep():
        return _run_sweep(cfg)


def _run_sweep(cfg: SweepConfig) -> dict:
    from adaspec.bench.server import ServerProcess, ServerStartError

    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    if cfg.force_new:
        start_over(out)
    mpath = out / "manifest.json"
    old = json.loads(mpath.read_text()) if mpath.is_file() else None
    measured = any((out / "points").glob("*.json"))
    if old is None and measured:
        raise BenchError(f"{out / 'points'} holds points but no manifest.json, so their settings are unknown; "
                         "use --force-new or a new --out directory")
    if old is not None and not measured:
        # an earlier sweep that measured nothing (its first server failed to start, say): nothing to
        # resume, so its settings bind nothing; it was refused as "points measured with other settings"
        cfg.log(f"note: the earlier sweep in {out} measured no point: starting anew with these settings")
        old = None
    if old is not None and "prompts_sha256_count" not in old:
        # from before: its prompts_sha256 covers its whole pool; this sweep's points hash the same count,
        # so old and new points of one directory compare alike
        cfg = dataclasses.replace(cfg, prompts_hashed=old_pool_size(old))
    # the earlier sweep's arms too: a new arm whose files would be an earlier arm's is refused
    refuse_slug_collisions([a["name"] for a in (old or {}).get("arms", [])] + [a.name for a in cfg.arms])
    manifest = build_manifest(cfg, old)
    machine = {k: manifest[k] for k in ("hardware", "engine_commit", "checkpoints")}
    run = {"start": conditions.now_iso(), "end": None, "points_run": 0, "points_skipped": 0,
           "host_speed": conditions.host_speed()}  # per run: a resumed sweep may run on another host
    manifest["runs"].append(run)
    write_json_atomic(str(mpath), manifest)

    for arm in cfg.arms:
        every = grid(cfg)
        todo = [(c, r) for c, r in every if not point_done(point_path(out, arm, c, r))]
        run["points_skipped"] += len(every) - len(todo)
        if not todo:
            cfg.log(f"[{arm.name}] all {len(every)} points done, skipped")
            continue
        server = None
        # the code this arm's points run: read again as its server starts (a commit made during a
        # sweep reaches the arms started after it); each point records it, the manifest lists them all
        commit = conditions.engine_commit()
        arm_machine = {**machine, "engine_commit": commit}
        if commit not in manifest["engine_commits"]:
            manifest["engine_commits"].append(commit)
            cfg.log(f"note: the engine commit changed during the sweep ({manifest['engine_commit']!r} -> {commit!r}); "
                    f"arm {arm.name}'s points record it, and the report marks the engine commit as mixed")
        if arm.name in cfg.base_urls:
            url = cfg.base_urls[arm.name]
        else:
            if changed := checkpoint_differences(manifest["checkpoints"], sweep_checkpoints(cfg)):
                # a rebuild during the sweep: this arm's points would measure other weights than the earlier arms'
                raise BenchError(f"the weights changed since the sweep started: {'; '.join(changed)}; "
                                 f"the points measured so far stay in {out}")
            spec = arm.speculative_config(cfg.drafter, cfg.temperature, cfg.spec_extra)
            server = ServerProcess(cfg.model, spec, out / "logs" / f"{arm.slug}.log", cfg.server_args, cfg.startup_timeout,
                                   cfg.launcher)
            cfg.log(f"[{arm.name}] starting server: {server.command_line()}")
            server.start()
            cfg.log(f"[{arm.name}] server ready in {server.startup_s:.1f} s")
            url = server.url
        alive = (lambda: server.proc.poll() is None) if server is not None else None

        def died_error(during: str, kept: bool = True) -> Exception:
            from adaspec.bench.server import tail

            what = "its point is kept as incomplete" if kept else "no point was written"
            return ServerStartError(f"server for arm {arm.name} died (code {server.proc.returncode}) {during}; "
                                    f"{what}, and a resume measures it again:\n{tail(server.log_path)}")

        try:
            for c, r in todo:
                where = "phases " + format_phases(cfg.load_phases) if c is PHASED else f"C={c}"
                try:
                    res = _run_point(cfg, arm, url, c, r, point_path(out, arm, c, r), arm_machine, alive)
                except BenchError:
                    if alive is not None and not alive():  # e.g. every warm-up failed because it died
                        raise died_error(f"during {where} repeat {r + 1}", kept=False) from None
                    raise
                run["points_run"] += 1
                # the record follows each point, so a sweep stopped anywhere says what it measured
                write_json_atomic(str(mpath), manifest)
                cfg.log(
                    f"[{arm.name}] {where} repeat {r + 1}/{cfg.repeats}: {res['completed']} ok, {res['failed']} failed, "
                    f"output {_f(res.get('output_throughput'))} tok/s, per-user {_f(res.get('median_per_user_tok_s'))} tok/s"
                    + (f"; first error: {next((e for e in res['errors'] if e), '')}" if not res["completed"] else "")
                    + "".join(f"\n    phase {ph['phase']} ({ph['max_concurrency']}x{ph['num_requests']}): output "
                              f"{_f(ph.get('output_throughput'))} tok/s, per-user {_f(ph.get('median_per_user_tok_s'))} tok/s, "
                              f"TTFT p50 {_f(ph.get('median_ttft_ms'))} ms" for ph in res.get("phases") or [])
                )
                if res.get("server_died"):
                    raise died_error(f"during {where} repeat {r + 1}")
        finally:
            if server is not None:
                server.stop()
        write_json_atomic(str(mpath), manifest)

    run["end"] = manifest["end_time"] = conditions.now_iso()
    write_json_atomic(str(mpath), manifest)
    result = {"manifest": manifest, "out": out}
    if cfg.report:
        from adaspec.bench.report import write_report

        result["report"] = write_report(out, html_too=False)
    return result


def _f(v) -> str:
    return "n/a" if v is None else f"{v:.1f}"


def parse_base_urls(items: list[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for it in items or []:
        if "=" not in it:
            raise BenchError(f"--base-url takes ARM=URL (e.g. none=http://127.0.0.1:8000), got {it!r}")
        name, url = it.split("=", 1)
        if not name or not url:
            raise BenchError(f"--base-url takes ARM=URL, got {it!r}")
        if name in out:
            raise BenchError(f"--base-url names arm {name!r} twice")
        out[name] = url
    return out


def arms_for(arms_text: str | None, base_urls: dict[str, str]) -> list[Arm]:
    """Arms to run: from --base-url when given (servers we did not start), else from --arms."""
    from adaspec.bench.arms import parse_arms, refuse_slug_collisions

    # a given '' is refused by name (parse_arms), not run as the default arms
    arms = [external_arm(n) for n in base_urls] if base_urls else \
        parse_arms("none,fixed:1,fixed:3,fixed:7,adaptive:7" if arms_text is None else arms_text)
    refuse_slug_collisions(a.name for a in arms)
    return arms
