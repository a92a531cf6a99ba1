"""What a new user sees from the command line: help texts, errors, refused output paths,
and the lines that say what a long wait is doing (issue 11)."""
import argparse
import json
import logging
import re
from dataclasses import fields
from pathlib import Path

import pytest

import adaspec
from adaspec.cli import build_parser, main

PKG = Path(adaspec.__file__).resolve().parent
README = PKG.parent / "README.md"
_FLAG_ACTIONS = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction,
                 argparse._AppendConstAction, argparse._CountAction, argparse._HelpAction, argparse._VersionAction)


def walk(parser):
    """(parser, command words) for the parser and every subparser below it."""
    out, todo = [], [(parser, ())]
    while todo:
        p, words = todo.pop(0)
        out.append((p, words))
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                seen = set()
                for name, sub in a.choices.items():
                    if id(sub) not in seen:
                        seen.add(id(sub))
                        todo.append((sub, words + (name,)))
    return out


def option_lines(parser):
    """{option string: its help as `--help` prints it (unwrapped)}."""
    fmt = parser._get_formatter()
    lines = {}
    for a in parser._actions:
        if a.option_strings and a.help != argparse.SUPPRESS:
            text = " ".join(fmt._format_action(a).split())
            lines[a.option_strings[-1]] = (a, text)
    return lines


def strip_default(text):
    return re.sub(r"\s*\(default: .*\)\s*$", "", text or "")


# -- help -----------------------------------------------------------------------------------
def test_every_option_shows_its_default_or_is_a_flag_or_required():
    missing = []
    for p, words in walk(build_parser()):
        for flag, (a, text) in option_lines(p).items():
            flag_like = isinstance(a, _FLAG_ACTIONS) or a.nargs == 0
            if not flag_like and not re.search(r"\bdefault\b|\(required\)", text, re.IGNORECASE):
                missing.append(f"adaspec {' '.join(words)} {flag}: {text!r}")
            if text.count("(required)") > 1 or text.count("(default:") > 1:
                missing.append(f"adaspec {' '.join(words)} {flag} says it twice: {text!r}")
    assert not missing, "options whose help shows no default:\n" + "\n".join(missing)


def test_the_help_formatter_shows_defaults_as_the_flags_take_them():
    lines = {w: option_lines(q) for q, w in walk(build_parser())}
    assert "(default: 1,16,32,64,128,256)" in lines[("bench", "sweep")]["--concurrency"][1]  # as typed
    assert "(default: 100)" in lines[("bench", "serve")]["--num-prompts"][1]
    # a default that is the model's own where it has one says so
    assert "(default: the model's max_new_tokens, else 64)" in lines[("generate",)]["--max-tokens"][1]
    assert "(default: 8000)" in lines[("serve",)]["--port"][1]  # declared without help
    assert "(required)" in lines[("eval", "drafter")]["--target"][1]


def test_every_command_has_a_description_and_help_has_no_markup():
    top = build_parser()
    for p, words in walk(top):
        assert p.description and p.description.strip(), f"adaspec {' '.join(words)} has no description"
        text = p.format_help()
        assert "`" not in text, f"adaspec {' '.join(words)} --help shows raw markup:\n{text}"
        assert "**" not in text


def test_help_runs_for_every_command(capsys):
    for p, words in walk(build_parser()):
        with pytest.raises(SystemExit) as e:
            main([*words, "--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: adaspec {' '.join(words)}".rstrip())


ENGINE_COMMANDS = [("generate",), ("serve",), ("profile",)]
ENGINE_FLAGS = ["MODEL", "--tokenizer", "--dtype", "--device", "--max-model-len", "--max-num-seqs",
                "--max-num-batched-tokens", "--block-size", "--num-kv-blocks", "--kv-cache-memory",
                "--attention-backend", "--speculative-config"]


def test_engine_options_have_one_help_text_in_every_engine_command():
    parsers = dict((w, p) for p, w in walk(build_parser()))
    for flag in ENGINE_FLAGS:
        texts = {}
        for words in ENGINE_COMMANDS:
            p = parsers[words]
            if flag == "MODEL":
                a = next(a for a in p._actions if a.dest == "model" and not a.option_strings)
            else:
                a = next(a for a in p._actions if flag in a.option_strings)
            texts[words] = strip_default(a.help)
        assert len(set(texts.values())) == 1, f"{flag} reads differently: {texts}"
        assert all(texts.values()), f"{flag} has no help: {texts}"
    # the engine defaults a user reads are EngineConfig's
    gen = option_lines(parsers[("generate",)])
    assert "(default: 256)" in gen["--max-num-seqs"][1]
    assert "(default: 4096)" in gen["--max-num-batched-tokens"][1]


@pytest.mark.parametrize("flag", ["--device", "--target", "--drafter", "--tokenizer", "--corpus", "--save-dtype",
                                  "--resume"])
def test_shared_options_read_the_same_everywhere(flag):
    texts = {}
    for p, words in walk(build_parser()):
        for a in p._actions:
            if flag in a.option_strings:
                texts[words] = strip_default(a.help)
    assert len(texts) >= 2
    assert len(set(texts.values())) == 1, f"{flag} reads differently: {texts}"


def test_engine_flags_pass_only_what_the_user_gave():
    from adaspec.commands.options import engine_kwargs

    args = build_parser().parse_args(["generate", "tiny", "--prompt", "x", "--max-num-seqs", "4",
                                      "--kv-cache-memory", "64MiB"])
    assert engine_kwargs(args) == {"max_num_seqs": 4, "kv_cache_memory": 64 * 2**20}
    # vllm's flags generate lacked
    args = build_parser().parse_args(["generate", "tiny", "--prompt", "x", "--enforce-eager", "--dtype", "half",
                                      "--gpu-memory-utilization", "0.5", "--generation-config", "vllm"])
    assert engine_kwargs(args) == {"enforce_eager": True, "dtype": "half", "gpu_memory_utilization": 0.5,
                                   "generation_config": "vllm"}


def test_readme_speculative_config_table_lists_every_key():
    from adaspec.config import SpeculativeConfig

    text = README.read_text()
    section = text[text.index("### Speculative config"):]
    section = section[: section.index("\n#", 1)]
    keys = set(re.findall(r"`([a-z_]+)`", "\n".join(line.split("|")[1] for line in section.splitlines()
                                                    if line.startswith("| `"))))
    assert keys == {f.name for f in fields(SpeculativeConfig)}


# -- unknown flags --------------------------------------------------------------------------
@pytest.mark.parametrize("argv,prog", [
    (["generate", "tiny", "--prompt", "x", "--bogus"], "adaspec generate"),
    (["bench", "sweep", "--out", "somewhere", "--bogus"], "adaspec bench sweep"),
    (["train", "calibrate", "--target", "tiny", "--drafter", "tiny-dspark", "--bogus", "1"],
     "adaspec train calibrate"),
])
def test_an_unknown_flag_is_reported_by_its_subcommand(argv, prog, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{prog}: error: unrecognized arguments: --bogus" in err
    assert err.startswith(f"usage: {prog} ")


# -- nothing is written into the installed package ------------------------------------------
def test_refuse_package_path():
    from adaspec.commands.writable import refuse_package_path
    from adaspec.errors import AdaspecError

    with pytest.raises(AdaspecError, match="inside the installed adaspec package"):
        refuse_package_path(PKG / "assets" / "x" / ".." / "new.png", "--plot")
    assert refuse_package_path(PKG.parent / "adaspec-out", "--out") == PKG.parent / "adaspec-out"
    assert refuse_package_path("relative/out", "--out") == Path("relative/out")


def _calibrate_must_not_run(monkeypatch):
    import adaspec.commands.eval as ev

    def reached(args):
        raise RuntimeError("reached the measurement")

    monkeypatch.setattr(ev, "load_pair", reached)


def _mtimes(d):
    return {p: p.stat().st_mtime_ns for p in Path(d).iterdir()}


def test_calibrate_refuses_to_write_into_the_packaged_drafter(monkeypatch, capsys, tmp_path):
    _calibrate_must_not_run(monkeypatch)
    drafter = PKG / "assets" / "models" / "tiny-dspark"
    before = _mtimes(drafter)
    # --dry-run: the reliability plot would land in the packaged drafter directory
    assert main(["train", "calibrate", "--target", "tiny", "--drafter", "tiny-dspark", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "inside the installed adaspec package" in err and "--plot" in err
    # without --dry-run: its config.json would be rewritten
    assert main(["train", "calibrate", "--target", "tiny", "--drafter", "tiny-dspark",
                 "--plot", str(tmp_path / "r.png")]) == 2
    err = capsys.readouterr().err
    assert "--drafter" in err and "config.json" in err and "inside the installed adaspec package" in err
    assert _mtimes(drafter) == before
    # a plot outside the package with --dry-run is fine: the run goes on to the measurement
    with pytest.raises(RuntimeError, match="reached the measurement"):
        main(["train", "calibrate", "--target", "tiny", "--drafter", "tiny-dspark", "--dry-run",
              "--plot", str(tmp_path / "r.png")])


INSIDE = str(PKG / "assets" / "out-of-place")


@pytest.mark.parametrize("argv", [
    ["profile", "tiny", "--out", INSIDE],
    ["eval", "drafter", "--target", "tiny", "--drafter", "tiny-dspark", "--json", INSIDE + ".json"],
    ["train", "calibrate", "--target", "tiny", "--drafter", "tiny-dspark", "--dry-run", "--plot", INSIDE + ".png"],
    ["train", "corpus", "--out", INSIDE],
    ["train", "tokenizer", "--corpus", "c", "--out", INSIDE],
    ["train", "target", "--corpus", "c", "--tokenizer", "t", "--out", INSIDE],
    ["train", "prompts", "--corpus", "c", "--tokenizer", "t", "--out", INSIDE + ".jsonl"],
    ["train", "card", "--model", str(PKG / "assets" / "models" / "tiny")],
    ["train", "drafter", "--target", "tiny", "--out", INSIDE],
    ["bench", "sweep", "--model", "tiny", "--out", INSIDE],
    ["bench", "serve", "--save-result", "--result-dir", INSIDE],
    ["bench", "report", str(PKG / "assets")],
    ["demo", "--out", INSIDE],
])
def test_every_writing_command_refuses_a_path_inside_the_package(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "inside the installed adaspec package" in err, err
    assert not Path(INSIDE).exists()


# -- model names ----------------------------------------------------------------------------
def test_a_hub_id_says_it_is_not_downloaded_and_lists_the_embedded_models(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["generate", "Qwen/Qwen3-0.6B", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "Hugging Face Hub id" in err and "does not download" in err and "local directory" in err
    assert "tiny (target)" in err and "tiny-dspark (drafter for tiny)" in err
    # a plain missing directory is not called a hub id, and still lists the embedded names
    assert main(["generate", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "model directory not found" in err and "Hub" not in err and "tiny (target)" in err


def test_a_drafter_given_as_target_says_how_to_use_it(capsys, tmp_path, micro_qwen3):
    from adaspec.testing import make_micro_drafter_dir

    assert main(["generate", "tiny-dspark", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "tiny-dspark is a DSpark drafter" in err and "lack" not in err
    assert """adaspec generate tiny --speculative-config '{"method": "dspark", "model": "tiny-dspark"}'""" in err
    d = make_micro_drafter_dir(tmp_path / "my-drafter", micro_qwen3, block_size=3)
    assert main(["generate", str(d), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert f"{d} is a DSpark drafter" in err and "speculative" in err


# -- long waits say what they are doing -----------------------------------------------------
def test_startup_profiling_says_what_it_does_then_that_it_read_the_cache(micro_qwen3, tmp_path, capsys, caplog):
    from adaspec import LLM
    from adaspec.spec_decode.profiler import TABLES_JSON_PREFIX
    from adaspec.testing import make_micro_drafter_dir

    d = make_micro_drafter_dir(tmp_path / "d", micro_qwen3, block_size=3)
    spec = {"method": "dspark", "model": str(d), "enable_adaptive_verification": True, "profile_repeats": 1,
            "cost_model_cache_dir": str(tmp_path / "cache")}
    kw = dict(speculative_config=spec, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64)
    caplog.set_level(logging.INFO, logger="adaspec.profile")
    LLM(str(micro_qwen3), **kw)
    said = capsys.readouterr().err + caplog.text
    m = re.search(r"profiling the adaptive policy's cost tables: (\d+) shapes x 1 runs \(cached at (\S+) afterwards\)",
                  said)
    assert m, said
    path = Path(m.group(2))
    assert path.is_file() and path.parent == tmp_path / "cache"
    # the server's log carries the tables it prices with as JSON (benchmarks/replay_policy.py --server-log)
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith(TABLES_JSON_PREFIX)]
    assert [json.loads(x[len(TABLES_JSON_PREFIX):]) for x in logged] == [json.loads(path.read_text())["model"]]
    caplog.clear()
    LLM(str(micro_qwen3), **kw)
    said = capsys.readouterr().err + caplog.text
    assert f"read cached cost tables from {path}" in said and "profiling the" not in said


def test_profiling_progress_bar_only_on_a_terminal(monkeypatch):
    import io
    import sys

    from adaspec.spec_decode.profiler import progress_bar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream, shown in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stream)
        with progress_bar(3, "cost tables") as bar:
            bar.update(3)
        assert ("cost tables" in stream.getvalue()) == shown


def test_eval_drafter_says_what_each_long_step_does(micro_qwen3, tmp_path, capsys):
    from adaspec.testing import make_micro_drafter_dir

    d = make_micro_drafter_dir(tmp_path / "d", micro_qwen3, block_size=3)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ["ab cd", "ef gh ij"]))
    out = tmp_path / "r.json"
    assert main(["eval", "drafter", "--target", str(micro_qwen3), "--drafter", str(d), "--prompts", str(prompts),
                 "--gen-len", "8", "--temperature", "0", "--device", "cpu", "--json", str(out)]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("adaspec: ")]
    assert any("loading target" in line for line in lines)
    assert any("the target generates 8 tokens for each of 2 prompts" in line for line in lines)
    assert any("scoring" in line for line in lines)
    assert json.loads(out.read_text())["num_prompts"] == 2


def _refused(argv, capsys) -> tuple[int, str]:
    """main(argv)'s exit code (argparse's SystemExit included) and its stderr."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    # output paths that can never be written: refused before the slow part (the results were lost after it)
    (["profile", "tiny", "--out", "{file}"], "exists and is not a directory"),
    (["eval", "drafter", "--target", "tiny", "--drafter", "tiny-dspark", "--json", "{dir}"], "is a directory, not a file"),
    (["eval", "drafter", "--target", "tiny", "--drafter", "tiny-dspark", "--blocks-out", "{file}/x.npz"],
     "is not a directory"),
    # numbers the evaluation cannot use (0 and -1 printed tables of NaN; NaN passed)
    (["eval", "drafter", "--target", "tiny", "--drafter", "tiny-dspark", "--batch-size", "0"], "must be >= 1, got 0"),
    (["eval", "drafter", "--target", "tiny", "--drafter", "tiny-dspark", "--num-prompts", "-1"], "must be >= 1"),
    (["eval", "drafter", "--target", "tiny", "--drafter", "tiny-dspark", "--temperature", "nan"], "must be >= 0.0"),
    (["train", "target", "--corpus", "c", "--tokenizer", "t", "--out", "o", "--layers", "0"], "must be >= 1, got 0"),
])
def test_bad_arguments_are_refused_as_they_are_parsed(argv, needle, tmp_path, capsys):
    """(parse_args only: a regression fails here at once, instead of running the command.)"""
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([a.format(file=tmp_path / "file", dir=tmp_path) for a in argv])
    assert e.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    # a device torch does not know, a backend this machine cannot run (tracebacks before)
    (["generate", "tiny", "--prompt", "hi", "--device", "foo"], "not a device torch knows"),
    (["generate", "tiny", "--prompt", "hi", "--device", "cpu", "--attention-backend", "triton"], "runs on CUDA"),
])
def test_bad_command_line_input_is_one_clear_error(argv, needle, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rc, err = _refused(argv, capsys)
    assert rc == 2 and needle in err and "Traceback" not in err, err


def test_corpus_splits_that_leave_no_train_split_are_refused(tmp_path):
    """--val-pct 80 --test-pct 80 built a corpus with an empty train split, and exited 0."""
    from adaspec.errors import AdaspecError
    from adaspec.train.corpus import build_corpus

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "m.py").write_text("x = 1\n")
    for val, test in ((80, 80), (150, 0), (-5, 5)):
        with pytest.raises(AdaspecError, match="leave the train split"):
            build_corpus(tmp_path / "c", source=tmp_path / "src", val_pct=val, test_pct=test)
    assert not (tmp_path / "c").exists()


def test_a_path_the_system_refuses_is_one_error_line_not_a_traceback(tmp_path, capsys):
    """An OSError (a path that cannot be made) out of any command is reported as such."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    (tmp_path / "m.py").write_text("x = 1\n")  # a source with a file to take
    rc, err = _refused(["train", "corpus", "--out", str(blocker / "sub"), "--source", str(tmp_path)], capsys)
    assert rc == 1 and err.startswith("adaspec: error: [Errno") and str(blocker) in err and "Traceback" not in err


def test_a_drain_timeout_of_nan_is_refused():
    """(Through settings_from_args, not main: a regression must fail here, not start a server.)"""
    from adaspec.errors import ConfigError
    from adaspec.serve.cli import settings_from_args

    with pytest.raises(ConfigError, match="--drain-timeout must be >= 0, got nan"):
        settings_from_args(build_parser().parse_args(["serve", "tiny", "--drain-timeout", "nan"]))


@pytest.mark.parametrize("argv, needle", [
    (["--arms", ""], "--arms is empty"),
    (["--out", ""], "--out takes a directory"),
    (["--output-len", "0"], "must be >= 1, got 0"),
])
def test_the_demos_options_are_taken_as_given(argv, needle, capsys):
    """'' and 0 were silently replaced by the defaults (the demo ran). Checked on the sweep the demo
    would run, not by running it: a regression must fail here, not run the demo."""
    from adaspec.bench.cli import sweep_config_from_args
    from adaspec.commands.demo import demo_sweep_args
    from adaspec.errors import AdaspecError

    opts = build_parser().parse_args(["demo", *argv])
    try:
        sweep_config_from_args(demo_sweep_args(opts), log=lambda *a: None)
    except AdaspecError as e:
        message = str(e)
    except SystemExit:  # the sweep's own parser refused it, and printed why
        message = capsys.readouterr().err
    else:
        pytest.fail(f"the demo took {argv}")
    assert needle in message
