"""`adaspec train pair`: the micro preset end to end on CPU, resumability, refusals, presets."""
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from adaspec.errors import AdaspecError
from adaspec.spec_decode.calibration import ece, prefix_labels
from adaspec.train.pair import STAGES, build_pair
from adaspec.train.pair_presets import apply_overrides, preset


def _micro_settings(src, *overrides):
    s = apply_overrides(preset("micro"), list(overrides))
    s["corpus"]["sources"] = [str(src)]
    return s


def _build(out, src, *overrides, **kw):
    logs = []
    summary = build_pair(out, _micro_settings(src, *overrides), preset_name="micro", name="micro", device="cpu",
                         log=logs.append, **kw)
    return summary, logs


@pytest.fixture(scope="module")
def pair(tmp_path_factory, make_tree):
    root = tmp_path_factory.mktemp("pair")
    src = make_tree(root / "src")
    summary, logs = _build(root / "out", src)
    return root / "out", src, summary, logs


def _manifests(out):
    return {s: json.loads((out / "manifest" / f"{s}.json").read_text()) for s in STAGES}


@pytest.mark.slow
def test_micro_pair_builds_every_stage(pair):
    out, _, summary, logs = pair
    assert summary["complete"] and set(summary["stage_seconds"]) == set(STAGES)
    assert [line for line in logs if line.endswith("running")] == [f"[{i}/8] {s}: running"
                                                                   for i, s in enumerate(STAGES, 1)]
    man = _manifests(out)
    assert all(m["done"] for m in man.values())
    assert [man[s]["input_build"] for s in STAGES[1:]] == [man[s]["build_id"] for s in STAGES[:-1]]
    # the figures of pair.json are the eval's, the target's and the calibration's own files
    on_disk = json.loads((out / "pair.json").read_text())
    assert on_disk["heldout"] == summary["heldout"]
    ev = json.loads((out / "drafter" / "eval.json").read_text())
    assert [summary["heldout"][f"T={r['temperature']:g}"]["tau"] for r in ev["runs"]] == [r["tau"] for r in ev["runs"]]
    assert ev["prompts"] == "eval-code" and [r["temperature"] for r in ev["runs"]] == [0.0, 1.0]
    for r in ev["runs"]:
        assert 1.0 <= r["tau"] <= 1.0 + r["k"] and r["blocks"] > 0
    with np.load(out / "drafter" / "heldout_blocks.npz") as blocks:  # the walk's blocks, for policy replays
        for r in ev["runs"]:
            acc = blocks["T%g_accepted" % r["temperature"]]
            assert float(np.mean(acc + 1.0)) == pytest.approx(r["tau_walk"])
            # the ECE over the walk's blocks is the one of the confidences saved beside them (float16)
            labels, _ = prefix_labels(acc.astype(np.int64), r["k"])
            conf = blocks["T%g_conf" % r["temperature"]].astype(np.float64)
            used = r.get("confidence_calibrated") or r["confidence_raw"]
            assert ece(np.cumprod(conf, axis=1), labels) == pytest.approx(used["ece_walk"], abs=2e-3)
            assert summary["heldout"][f"T={r['temperature']:g}"]["ece_calibrated_walk"] == used["ece_walk"]
    stats = json.loads((out / "target" / "train_stats.json").read_text())
    assert summary["target"]["val_loss"] == stats["val_loss"] < math.log(512) - 1.0  # learned something
    # where a drafter training step's time went: 2 steps from halfway (40 // 2), CPU ops on this machine
    prof = summary["drafter"]["step_profile"]
    assert prof == json.loads((out / "drafter" / "step_profile.json").read_text())
    assert (prof["steps"], prof["first_step"], prof["timer"]) == (2, 20, "CPU ops") and prof["wall_ms_per_step"] > 0
    assert 0 < len(prof["top"]) <= 12 and sum(r["share"] for r in prof["top"]) <= 1.0001
    assert [r["ms_per_step"] for r in prof["top"]] == sorted((r["ms_per_step"] for r in prof["top"]), reverse=True)
    assert "ms wall per step" in (out / "drafter" / "step_profile.txt").read_text()
    # and a self-distillation decode step's: 2 steps from halfway through the 32 generated tokens
    sd = summary["selfdistill"]
    assert sd["rows"] == 48 and (sd["step_profile"]["steps"], sd["step_profile"]["first_step"]) == (2, 16)
    assert sd["step_profile"]["top"] and sd["step_profile"]["wall_ms_per_step"] > 0
    # and a target training step's: 2 steps from step 60 (after the time budget's probe), into train_stats.json
    tp = summary["target"]["step_profile"]
    assert (tp["steps"], tp["first_step"], tp["timer"]) == (2, 60, "CPU ops") and tp["top"]
    assert tp == stats["step_profile"] == json.loads((out / "target" / "step_profile" / "step_profile.json").read_text())
    cfg = json.loads((out / "drafter" / "config.json").read_text())
    assert cfg["block_size"] == 4 and len(cfg["adaspec"]["confidence_temperatures"]) == 4
    assert len(cfg["adaspec"]["confidence_temperatures_greedy"]) == 4
    # the calibration: cross-fitted, adopted or kept at 1.0, never worse than raw out of fold
    for t, key in (("T=1", "confidence_temperatures"), ("T=0", "confidence_temperatures_greedy")):
        c = summary["calibration"][t]
        assert isinstance(c["adopted"], bool) and c["temperatures"] == cfg["adaspec"][key]
        assert c["ece_after"] <= c["ece_before"] and c["ece_fitted"] is not None
        if not c["adopted"]:
            assert c["temperatures"] == [1.0] * 4 and c["ece_after"] == c["ece_before"]
    # per-source token counts reached the corpus stats
    cstats = json.loads((out / "corpus" / "stats.json").read_text())
    assert sum(cstats["tokens"]["splits"]["train"]["by_source"].values()) == summary["tokenizer"]["tokens"]["train"]
    # cards carry the held-out figures and the settings
    tcard = (out / "target" / "MODEL_CARD.md").read_text()
    dcard = (out / "drafter" / "MODEL_CARD.md").read_text()
    for r in ev["runs"]:
        assert f"**{r['tau']:.2f}**" in tcard and f"**{r['tau']:.2f}**" in dcard
    assert "target.layers = 2" in tcard and '"markov_rank": 8' in dcard and "# micro-dspark" in dcard
    assert dcard.count("| fitted T_j |") == 2 and "each scored with temperatures fitted on the other" in dcard


@pytest.mark.slow
def test_pair_loads_in_the_engine_and_speculation_is_lossless(pair):
    from adaspec import LLM, SamplingParams

    out = pair[0]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["def add(a, b):\n", "import os\n\n\nclass Config:\n"]
    plain = [o.outputs[0].token_ids for o in LLM(str(out / "target")).generate(prompts, params)]
    llm = LLM(str(out / "target"), speculative_config={"method": "dspark", "model": str(out / "drafter")})
    spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert spec == plain
    assert llm.llm_engine.stats.num_draft_tokens > 0


@pytest.mark.slow
def test_rerun_skips_every_stage(pair):
    out, src, _, _ = pair
    before = _manifests(out)
    mtime = (out / "drafter" / "model.safetensors").stat().st_mtime_ns
    _, logs = _build(out, src)
    assert [line for line in logs if "skipped" in line] and not [line for line in logs if "running" in line]
    assert _manifests(out) == before
    assert (out / "drafter" / "model.safetensors").stat().st_mtime_ns == mtime


@pytest.mark.slow
def test_changed_setting_is_refused_naming_it(pair):
    out, src, _, _ = pair
    before = _manifests(out)
    with pytest.raises(AdaspecError, match=r"target\.lr: built with 0\.003, now 0\.01.*--restart-from target"):
        _build(out, src, "target.lr=0.01")
    with pytest.raises(AdaspecError, match=r"stage 'drafter'.*drafter\.steps: built with 40, now 41"):
        _build(out, src, "drafter.steps=41")
    with pytest.raises(AdaspecError, match=r"stage 'selfdistill'.*drafter\.sd_num_seqs"):
        _build(out, src, "drafter.sd_num_seqs=64")
    assert _manifests(out) == before  # a refusal changes nothing


@pytest.mark.slow
def test_restart_from_rebuilds_that_stage_and_later_ones(pair, tmp_path):
    out, src, _, _ = pair
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    before = _manifests(copy)
    _, logs = _build(copy, src, restart_from="eval")
    after = _manifests(copy)
    assert [s for s in STAGES if after[s]["build_id"] != before[s]["build_id"]] == ["eval", "cards"]
    assert after["eval"]["result"] == before["eval"]["result"]  # fixed seeds: the same figures again
    assert (copy / "target" / "MODEL_CARD.md").is_file()


@pytest.mark.slow
def test_interrupted_stage_resumes_and_a_rebuilt_input_is_refused(pair, tmp_path):
    out, src, _, _ = pair
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    m = json.loads((copy / "manifest" / "cards.json").read_text())
    m["done"] = False  # as if the process died inside the stage
    (copy / "manifest" / "cards.json").write_text(json.dumps(m))
    _, logs = _build(copy, src)
    assert [line for line in logs if "running" in line] == ["[8/8] cards: running"]
    assert "[8/8] cards: resuming an interrupted run" in logs
    m = json.loads((copy / "manifest" / "eval.json").read_text())
    m["build_id"] = "another"
    (copy / "manifest" / "eval.json").write_text(json.dumps(m))
    with pytest.raises(AdaspecError, match=r"stage 'cards'.*another build of stage 'eval'"):
        _build(copy, src)


@pytest.mark.slow
def test_train_path_never_imports_the_server(pair, tmp_path):
    """The GPU machine has no fastapi/uvicorn: the pair command must run without them."""
    out, src, _, _ = pair
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    blocked = ["fastapi", "uvicorn", "starlette", "pydantic", "aiohttp", "httpx", "openai", "hypothesis"]
    code = ("import sys\n"
            f"for m in {blocked!r}: sys.modules[m] = None\n"
            "from adaspec.cli import main\n"
            f"sys.exit(main(['train', 'pair', '--preset', 'micro', '--out', {str(copy)!r}, '--source', {str(src)!r},"
            " '--device', 'cpu', '--restart-from', 'calibrate']))\n")
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "held-out T=0: tau" in r.stdout


def test_presets_and_overrides():
    s = preset("code-0.6b")
    t = s["target"]
    # Qwen3-0.6B's shape
    assert (t["layers"], t["hidden"], t["heads"], t["kv_heads"], t["head_dim"], t["intermediate"]) == \
        (28, 1024, 16, 8, 128, 3072)
    assert s["drafter"]["block_size"] == 7 and s["drafter"]["layers"] == 2  # H200 run 15: +14% tau over 1
    assert s["calibrate"]["prompts"] == "eval-code"  # disjoint from the eval's prompts (test below)
    assert s["eval"]["prompts"] == "eval-code" and "stdlib" in s["corpus"]["sources"]
    assert preset("code-0.6b") == s and preset("code-0.6b") is not s  # a copy each time
    o = apply_overrides(preset("micro"), ["target.layers=3", "corpus.sources=[\"stdlib\"]", "drafter.init=random"])
    assert o["target"]["layers"] == 3 and o["corpus"]["sources"] == ["stdlib"] and o["drafter"]["init"] == "random"
    for bad, msg in [("target.nope=1", "unknown key 'nope'"), ("nope.x=1", "unknown section"),
                     ("target.layers", "SECTION.KEY=VALUE")]:
        with pytest.raises(AdaspecError, match=msg):
            apply_overrides(preset("micro"), [bad])
    with pytest.raises(AdaspecError, match="unknown"):
        preset("nope")


def test_code_06b_sizing_matches_the_written_arithmetic():
    """The preset's comment: 457.2M parameters, 2.92 GFLOP per token, target ~114 s at 40% MFU."""
    import torch

    from adaspec.models.target import TargetModel
    from adaspec.train.pair import target_flops_per_token
    from adaspec.train.target import build_config, count_params

    s = preset("code-0.6b")
    t = s["target"]

    class A:  # the fields build_config reads
        arch, layers, hidden, heads, kv_heads, head_dim = "qwen3", t["layers"], t["hidden"], t["heads"], t["kv_heads"], \
            t["head_dim"]
        intermediate, max_position, rope_theta, untied, seq_len = t["intermediate"], t["max_position"], \
            t["rope_theta"], False, t["seq_len"]

    cfg = build_config(A, s["tokenizer"]["vocab_size"], 0)
    with torch.device("meta"):
        n = count_params(TargetModel(cfg))
    assert abs(n - 457.2e6) < 0.1e6
    fpt = target_flops_per_token(cfg.to_hf(), t["seq_len"])
    assert abs(fpt - 2.92e9) < 0.01e9
    seconds = t["steps"] * t["batch_size"] * t["seq_len"] * fpt / (0.4 * 989e12)
    assert 100 < seconds < t["time_budget"] - 30  # leaves room for compile and evaluation


def test_cli_lists_pair_and_rejects_a_bad_set(tmp_path, capsys):
    from adaspec.cli import main

    with pytest.raises(SystemExit):
        main(["train", "pair", "--help"])
    assert "--restart-from" in capsys.readouterr().out
    assert main(["train", "pair", "--preset", "micro", "--out", str(tmp_path), "--set", "target.bogus=1"]) == 2
    assert "unknown key 'bogus'" in capsys.readouterr().err


@pytest.mark.slow
def test_gpu_build_script_runs_and_reports(pair, tmp_path):
    """benchmarks/build_pair_h200.sh at micro size on the CPU: its plumbing (argument forwarding, the
    figures folder, the summary at the end) must work the first time it meets the GPU machine."""
    out, src, _, _ = pair
    copy, figs = tmp_path / "out", tmp_path / "figs"
    shutil.copytree(out, copy)
    env = dict(os.environ, PYTHONPATH=os.getcwd(), PYTHON=sys.executable, PRESET="micro", DEVICE="cpu")
    r = subprocess.run(["bash", "benchmarks/build_pair_h200.sh", str(copy), str(figs), "--", "--source", str(src)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    last = r.stdout.strip().splitlines()[-5:]
    assert last[0].startswith("stage seconds:") and last[-1].startswith("held-out T=1: tau")
    # the preset's held-out self-distilled rows against training rows, measured alike
    assert last[2].startswith("drafter soft acceptance per slot, held-out self-distilled rows ")
    assert json.loads((figs / "pair.json").read_text())["complete"]
    for f in ("target/MODEL_CARD.md", "drafter/MODEL_CARD.md", "drafter/eval.json", "build.log", "manifest/eval.json"):
        assert (figs / f).is_file(), f
    assert not (figs / "target" / "model.safetensors").exists()  # weights stay in DIR


@pytest.mark.parametrize("name", ["micro", "code-0.6b"])
def test_the_preset_holds_out_rows_its_self_distillation_makes(name):
    """A preset's --heldout-rows must fit what its selfdistill stage makes, or the drafter stage
    fails minutes into a GPU build: a multiple of the batch, and both measured sets (the held-out
    rows and the training rows just before them) among the sampled rows, which come after the
    greedy ones, so that the two sets are of one kind."""
    d = preset(name)["drafter"]
    n = d.get("heldout_rows") or 0
    if not n:
        pytest.skip(f"{name} holds out no rows")
    sampled = d["sd_num_seqs"] - int(round(d["sd_num_seqs"] * d["sd_greedy_frac"]))
    assert n % d["batch_size"] == 0
    assert sampled >= 2 * n, (sampled, n)
    assert d["sd_batch"] >= 1 and d["heldout_every"] >= 1


@pytest.mark.parametrize("name", ["micro", "code-0.6b"])
def test_every_preset_setting_is_a_flag_of_its_command(name, tmp_path):
    """The stages pass target/drafter settings as command flags: each must parse, to the value given."""
    from adaspec.train import drafter, target
    from adaspec.train.pair import SELF_DISTILL_KEYS, _flags, _parse

    s = preset(name)
    t = _parse(target.add_subparser, ["target", "--corpus", "c", "--tokenizer", "t", "--out", "o", *_flags(s["target"])])
    for k, v in s["target"].items():
        assert getattr(t, k) == (v if v is not None else getattr(t, k)), k
    d_set = {k: v for k, v in s["drafter"].items() if not k.startswith("sd_")}
    d = _parse(drafter.add_subparser, ["drafter", "--target", "x", "--out", "o", *_flags(d_set)])
    for k, v in s["drafter"].items():
        assert hasattr(d, k), k  # sd_* keys are flags too (the selfdistill stage reads them by these names)
        if not k.startswith("sd_") and v is not None:
            assert getattr(d, k) == v, k
    assert set(SELF_DISTILL_KEYS) <= set(s["drafter"])


@pytest.mark.slow
def test_a_failing_stage_is_named_in_pair_json_and_a_refusal_leaves_it(pair, tmp_path, monkeypatch):
    from adaspec.train import pair as pair_mod

    out, src, _, _ = pair
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    good = (copy / "pair.json").read_text()
    with pytest.raises(AdaspecError):
        _build(copy, src, "target.lr=0.01")
    assert (copy / "pair.json").read_text() == good

    def boom(ctx):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setitem(pair_mod.STAGE_FUNCS, "eval", boom)
    with pytest.raises(RuntimeError, match="simulated"):
        _build(copy, src, restart_from="eval")
    s = json.loads((copy / "pair.json").read_text())
    assert not s["complete"] and s["failed"]["stage"] == "eval" and "simulated" in s["failed"]["error"]
    assert s["heldout"] is None and s["target"]["val_loss"] > 0  # done stages still reported
    assert "FAILED in stage eval" in pair_mod.format_summary(s)
    assert json.loads((copy / "manifest" / "eval.json").read_text())["done"] is False


@pytest.mark.slow
@pytest.mark.parametrize("source", ["val", "eval-code"])
def test_calibration_prompts_never_overlap_the_eval_prompts(pair, source, monkeypatch):
    """calibrate.prompts=eval-code calibrates on the packaged eval-code prompts AFTER those the eval
    stage scores (same distribution as the held-out figures, none of its prompts); "val" on val-split
    windows. The calibrate command is stubbed: what is checked is the prompt set it would load."""
    import numpy as np

    from adaspec.models.tokenizer import Tokenizer
    from adaspec.train import calibrate
    from adaspec.train.drafter_eval import load_prompts
    from adaspec.train.pair import Context, _calibrate

    out, src, _, _ = pair
    settings = _micro_settings(src, f"calibrate.prompts={source}")
    ctx = Context(out, settings, "micro", "micro", "cpu")
    seen = []
    monkeypatch.setattr(calibrate, "run", lambda args: seen.append(args) or 0)
    _calibrate(ctx)  # reads the calibration files the fixture's build wrote
    assert [a.temperature for a in seen] == [1.0, 0.0]
    tok = Tokenizer.from_dir(ctx.target)
    e = settings["eval"]
    evaluated = load_prompts(e["prompts"], tok, e["num_prompts"], e["max_prompt_len"])
    a = seen[0]
    calib = load_prompts(a.prompts, tok, a.num_prompts, a.max_prompt_len, skip=a.skip_prompts)
    assert len(calib) == settings["calibrate"]["num_prompts"]
    if source == "eval-code":
        assert (a.prompts, a.skip_prompts) == ("eval-code", e["num_prompts"])
        # the eval's prompts are the set's first ones: the calibration starts right after them
        every = load_prompts("eval-code", tok, None, a.max_prompt_len)
        assert calib == every[e["num_prompts"]: e["num_prompts"] + len(calib)]
    else:
        assert a.skip_prompts == 0 and a.prompts.endswith("prompts.npy")
        assert np.load(a.prompts).shape == (settings["calibrate"]["num_prompts"], settings["calibrate"]["prompt_len"])
    assert not {tuple(p) for p in calib} & {tuple(p[-a.max_prompt_len:]) for p in evaluated}


def test_calibration_prompt_source_errors_name_the_setting(tmp_path):
    from adaspec.train.pair import Context, _calibrate

    s = preset("micro")
    s["calibrate"]["prompts"] = "test"
    with pytest.raises(AdaspecError, match="calibrate.prompts='test': choose one of val, eval-code"):
        _calibrate(Context(tmp_path, s, "micro", "micro", "cpu"))
    s = apply_overrides(preset("micro"), ["calibrate.prompts=eval-code", "eval.prompts=my.jsonl"])
    with pytest.raises(AdaspecError, match="needs eval.prompts=eval-code"):
        _calibrate(Context(tmp_path, s, "micro", "micro", "cpu"))


def test_load_prompts_skip(tmp_path):
    import numpy as np

    from adaspec.train.drafter_eval import load_prompts

    f = tmp_path / "p.npy"
    np.save(f, np.arange(15).reshape(5, 3))
    assert load_prompts(str(f), None, limit=1, skip=3) == [[9, 10, 11]]
    assert load_prompts(str(f), None, skip=3) == [[9, 10, 11], [12, 13, 14]]
    with pytest.raises(AdaspecError, match="skipping the first 5 leaves none"):
        load_prompts(str(f), None, skip=5)
    with pytest.raises(AdaspecError, match="--skip-prompts must be >= 0"):
        load_prompts(str(f), None, skip=-1)


@pytest.mark.slow
def test_drafter_variants_script_retrains_from_the_right_stage(pair, tmp_path):
    """benchmarks/h200_drafter_variants.sh at micro size on the CPU: each variant is a copy of the
    base build retrained from the first stage its sets touch, evaluated as the preset would, and
    tabled beside the base; a set that is not the drafter's is refused before any work."""
    out, src, summary, _ = pair
    base = tmp_path / "base"
    shutil.copytree(out, base)
    env = dict(os.environ, PYTHONPATH=os.getcwd(), PYTHON=sys.executable, PRESET="micro", DEVICE="cpu",
               BASE=str(base), VARIANT_ROOT=str(tmp_path), EST_S="1",
               VARIANTS="lr=drafter.lr=0.01;sd=drafter.sd_num_seqs=24,drafter.steps=20")
    cmd = ["bash", "benchmarks/h200_drafter_variants.sh", str(tmp_path / "res"), "--", "--source", str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {x["variant"]: x for x in json.loads((tmp_path / "res" / "variants.json").read_text())}
    assert list(rows) == ["base", "lr", "sd"] and all(x["complete"] for x in rows.values())
    assert rows["base"]["heldout"]["T=0"]["tau"] == summary["heldout"]["T=0"]["tau"]
    lr = json.loads((tmp_path / "pair-lr" / "manifest" / "drafter.json").read_text())
    assert lr["settings"]["drafter"]["lr"] == 0.01
    sd_man = json.loads((tmp_path / "pair-sd" / "manifest" / "selfdistill.json").read_text())
    assert sd_man["settings"]["drafter"]["sd_num_seqs"] == 24  # rebuilt from selfdistill
    lr_sd = json.loads((tmp_path / "pair-lr" / "manifest" / "selfdistill.json").read_text())
    assert lr_sd == json.loads((base / "manifest" / "selfdistill.json").read_text())  # kept: drafter only
    assert rows["sd"]["drafter"]["steps"] == 20
    assert "variant" in r.stdout and "sd" in (tmp_path / "res" / "variants.txt").read_text()
    # the preset's held-out self-distilled rows against training rows, per variant
    assert all(len(x["drafter"]["rows_heldout"]["accept"]) == 4 for x in rows.values())
    base_line = next(x for x in (tmp_path / "res" / "variants.txt").read_text().splitlines() if x.startswith("base "))
    s1 = rows["base"]["drafter"]
    assert f" {s1['rows_heldout']['accept'][0]:.2f}/{s1['rows_train']['accept'][0]:.2f} " in base_line
    import tarfile
    names = tarfile.open(tmp_path / "res" / "variants_logs.tar.gz").getnames()
    assert "./sd/drafter/eval.json" in names and "./base/pair.json" in names, names
    assert "./sd/drafter/heldout_blocks.npz" in names, names  # each build's walk blocks, for replay_policy.py
    # REQUIRE_PAIR=1 on a machine without the base build: exit 4 at once, building nothing
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                       env=dict(env, BASE=str(tmp_path / "nobase"), REQUIRE_PAIR="1"))
    assert r.returncode == 4 and f"no built pair in {tmp_path / 'nobase'}" in r.stderr, r.stderr
    assert not (tmp_path / "nobase").exists() and "building" not in r.stdout
    # bad variants fail fast, naming the problem
    for bad, why in (("x=target.layers=3", "not drafter.KEY=VALUE"), ("nolabel", "expected LABEL=")):
        r = subprocess.run(cmd, capture_output=True, text=True, env=dict(env, VARIANTS=bad), timeout=60)
        assert r.returncode == 2 and why in r.stderr, r.stderr
