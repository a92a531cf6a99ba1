"""`adaspec serve` flags: parsed without heavy imports, mapped onto EngineConfig and ServerSettings."""
from __future__ import annotations

import subprocess
import sys

import pytest

from adaspec.cli import build_parser
from adaspec.errors import ConfigError
from adaspec.serve.cli import engine_config_from_args, parse_bytes, settings_from_args


def _args(*argv):
    return build_parser().parse_args(["serve", *argv])


def test_flags_map_onto_engine_config_and_settings():
    a = _args("some/model", "--speculative-config", '{"method": "dspark", "num_speculative_tokens": 3}',
              "--host", "0.0.0.0", "--port", "9001", "--api-key", "k", "--served-model-name", "m1", "m2",
              "--max-num-seqs", "12", "--max-model-len", "1024", "--max-num-batched-tokens", "2048",
              "--num-kv-blocks", "99", "--kv-cache-memory", "512MiB", "--enforce-eager", "--max-queue", "7",
              "--dtype", "float32", "--device", "cpu", "--seed", "3", "--drain-timeout", "2.5")
    cfg = engine_config_from_args(a)
    assert (cfg.model, cfg.max_num_seqs, cfg.max_model_len, cfg.max_num_batched_tokens) == ("some/model", 12, 1024, 2048)
    assert (cfg.num_kv_blocks, cfg.kv_cache_memory, cfg.enforce_eager) == (99, 512 * 2**20, True)
    assert (cfg.dtype, cfg.device, cfg.seed) == ("float32", "cpu", 3)
    assert cfg.speculative_config == {"method": "dspark", "num_speculative_tokens": 3}
    st = settings_from_args(a)
    assert st.served_model_names == ["m1", "m2"] and st.api_key == "k"
    assert (st.max_queue, st.drain_timeout, st.model_path) == (7, 2.5, "some/model")
    assert (a.host, a.port) == ("0.0.0.0", 9001)


def test_defaults_leave_engine_defaults_alone():
    a = _args("m")
    cfg = engine_config_from_args(a)
    from adaspec.config import EngineConfig

    assert cfg == EngineConfig(model="m")
    assert (a.host, a.port) == ("127.0.0.1", 8000)  # loopback unless told otherwise
    st = settings_from_args(a)
    assert st.served_model_names == ["m"] and st.api_key is None and st.max_queue is None


def test_bad_values_are_config_errors():
    with pytest.raises(ConfigError):
        engine_config_from_args(_args("m", "--speculative-config", "{not json"))
    with pytest.raises(ConfigError):
        engine_config_from_args(_args("m", "--max-num-seqs", "0"))
    with pytest.raises(ConfigError):
        settings_from_args(_args("m", "--max-queue", "0"))


def test_parse_bytes():
    assert parse_bytes("1024") == 1024
    assert parse_bytes("4GiB") == 4 * 2**30
    assert parse_bytes("1.5 GB") == 1_500_000_000
    with pytest.raises(Exception):
        parse_bytes("lots")


def test_serve_help_does_not_import_the_server_stack():
    code = ("import sys, argparse; import adaspec.serve.cli as c; "
            "c.add_parser(argparse.ArgumentParser().add_subparsers()); "
            "print(any(m in sys.modules for m in ('fastapi', 'uvicorn', 'torch', 'adaspec.serve.app')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=__file__.rsplit("/tests/", 1)[0])
    assert out.stdout.strip() == "False"


def test_api_key_from_environment(monkeypatch):
    monkeypatch.setenv("ADASPEC_API_KEY", "from-env")
    assert settings_from_args(_args("m")).api_key == "from-env"
    assert settings_from_args(_args("m", "--api-key", "flag")).api_key == "flag"


def test_missing_model_is_a_clean_error(tmp_path, capsys):
    pytest.importorskip("adaspec.engine.llm_engine")
    from adaspec.cli import main

    assert main(["serve", str(tmp_path / "nope"), "--port", "0"]) == 2
    assert "adaspec: error:" in capsys.readouterr().err


def _main_err(capsys, *argv):
    from adaspec.cli import main

    rc = main(["serve", *argv])
    err = capsys.readouterr().err
    return rc, err


def test_a_busy_port_is_reported_before_the_model_loads(tmp_path, capsys):
    # the model does not exist: had it been loaded first, that would be the error
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc, err = _main_err(capsys, str(tmp_path / "nope"), "--port", str(port))
    assert rc == 2
    assert f"cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, needle", [
    (["--port", "99999"], "--port must be in [0, 65535], got 99999"),
    (["--port", "-1"], "--port must be in [0, 65535]"),
    (["--speculative-config", "[1,2]"], "--speculative-config must be a JSON object"),
    (["--speculative-config", "7"], "--speculative-config must be a JSON object"),
    (["--speculative-config", "{nope"], "--speculative-config is not valid JSON"),
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must be in (0, 1]"),
    (["--gpu-memory-utilization", "0"], "gpu_memory_utilization must be in (0, 1]"),
    (["--max-request-body-bytes", "0"], "--max-request-body-bytes must be >= 1"),
])
def test_bad_serve_flags_are_one_line_errors(tmp_path, capsys, argv, needle):
    rc, err = _main_err(capsys, str(tmp_path / "nope"), *argv)
    assert rc == 2
    assert needle in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_new_serve_flags_map_onto_config_and_settings():
    a = _args("m", "--gpu-memory-utilization", "0.8", "--max-request-body-bytes", "4MiB", "--disable-log-requests")
    assert engine_config_from_args(a).gpu_memory_utilization == 0.8
    st = settings_from_args(a)
    assert st.max_request_body_bytes == 4 * 2**20 and st.disable_log_requests is True
    st = settings_from_args(_args("m"))
    from adaspec.serve.state import DEFAULT_MAX_REQUEST_BODY_BYTES

    assert st.max_request_body_bytes == DEFAULT_MAX_REQUEST_BODY_BYTES and st.disable_log_requests is False


def test_engine_process_is_the_default_on_cuda_only(monkeypatch):
    monkeypatch.delenv("ADASPEC_DEVICE", raising=False)
    assert settings_from_args(_args("m", "--device", "cuda")).engine_process is True
    assert settings_from_args(_args("m", "--device", "cuda:1")).engine_process is True
    assert settings_from_args(_args("m", "--device", "cpu")).engine_process is False
    # tensor parallelism keeps the thread (the process is not measured there)
    assert settings_from_args(_args("m", "--device", "cuda", "-tp", "2")).engine_process is False
    # the flags win both ways
    assert settings_from_args(_args("m", "--device", "cpu", "--engine-process")).engine_process is True
    assert settings_from_args(_args("m", "--device", "cuda", "--no-engine-process")).engine_process is False
    # "auto" follows $ADASPEC_DEVICE, then whether CUDA is present, as the engine resolves it
    monkeypatch.setenv("ADASPEC_DEVICE", "cpu")
    assert settings_from_args(_args("m")).engine_process is False
    monkeypatch.setenv("ADASPEC_DEVICE", "cuda")
    assert settings_from_args(_args("m")).engine_process is True
    monkeypatch.delenv("ADASPEC_DEVICE")
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert settings_from_args(_args("m")).engine_process is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert settings_from_args(_args("m")).engine_process is False


def test_api_server_count_turns_the_engine_process_on_and_refuses_what_cannot_work(monkeypatch):
    monkeypatch.delenv("ADASPEC_DEVICE", raising=False)
    s = settings_from_args(_args("m", "--device", "cpu", "--api-server-count", "3"))
    assert (s.api_server_count, s.engine_process) == (3, True)  # on CPU the default would be the thread
    assert settings_from_args(_args("m", "--device", "cpu")).api_server_count == 1
    assert settings_from_args(_args("m", "--device", "cpu", "-asc", "2")).api_server_count == 2
    with pytest.raises(ConfigError, match="--api-server-count must be >= 1"):
        settings_from_args(_args("m", "--api-server-count", "0"))
    with pytest.raises(ConfigError, match="--no-engine-process"):
        settings_from_args(_args("m", "--api-server-count", "2", "--no-engine-process"))


def test_api_detokenize_is_on_with_several_api_servers_and_needs_the_engine_process(monkeypatch):
    monkeypatch.delenv("ADASPEC_DEVICE", raising=False)
    assert settings_from_args(_args("m", "--device", "cpu", "-asc", "2")).api_detokenize is True
    assert settings_from_args(_args("m", "--device", "cpu", "-asc", "2", "--no-api-detokenize")).api_detokenize is False
    assert settings_from_args(_args("m", "--device", "cuda")).api_detokenize is False  # one API server
    assert settings_from_args(_args("m", "--device", "cuda", "--api-detokenize")).api_detokenize is True
    with pytest.raises(ConfigError, match="--api-detokenize needs the engine in a process of its own"):
        settings_from_args(_args("m", "--device", "cpu", "--api-detokenize"))
