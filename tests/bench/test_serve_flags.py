"""`bench serve` flags and console: refusals by name, vLLM's flags (--backend kept as given,
--goodput's console line, --served-model-name, sampling parameters, request ids, the ready check,
--save-detailed), the model looked up for --dataset random, and the busy-client warning."""
import json

import pytest

from adaspec.cli import main

from .fakeserver import FakeServer, Script

SC = Script(chunks=[(0.0, "a", 1), (0.0, "bc", 2)], prompt_tokens=3)
UNREACHABLE = "http://127.0.0.1:9"


def test_negative_warmups_are_refused_by_name(tmp_path, capsys):
    base = ["--model", "m", "--dataset", "random", "--tokenizer", "tiny", "--random-input-len", "4",
            "--num-warmups", "-1", "--disable-tqdm"]
    assert main(["bench", "serve", "--base-url", UNREACHABLE, "--num-prompts", "1"] + base) == 2
    assert "--num-warmups must be at least 0, got -1" in capsys.readouterr().err
    assert main(["bench", "sweep", "--arms", "none", "--out", str(tmp_path / "o")] + base) == 2
    assert "--num-warmups must be at least 0, got -1" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
