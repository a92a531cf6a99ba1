"""benchmarks/target_shapes.py: several target depths on one corpus and tokenizer, their val losses
tabled (at micro size on the CPU, so that its plumbing works the first time it meets the GPU)."""
import json

import pytest

from adaspec.testing import load_benchmark

target_shapes = load_benchmark("target_shapes")


def test_shapes_share_one_corpus_and_tokenizer_and_table_their_own_losses(tmp_path, make_tree, capsys):
    src = make_tree(tmp_path / "src")
    out, figs = tmp_path / "out", tmp_path / "figs"
    rc = target_shapes.main(["--out", str(out), "--figures", str(figs), "--layers", "2,1", "--preset", "micro",
                             "--source", str(src), "--device", "cpu", "--set", "target.steps=12",
                             "--set", "target.eval_every=6"])
    assert rc == 0
    res = json.loads((figs / "shapes.json").read_text())
    assert [r["layers"] for r in res["shapes"]] == [2, 1] and res["partial"] is False
    assert res["budget_s"] is None and res["preset"] == "micro"
    base_tok = json.loads((out / "base" / "manifest" / "tokenizer.json").read_text())["build_id"]
    for r in res["shapes"]:
        d = out / f"L{r['layers']}"
        man = json.loads((d / "manifest" / "target.json").read_text())
        # every shape's target stage ran on the base's tokenizer build, not on one of its own
        assert man["input_build"] == base_tok
        assert man["settings"]["target"]["layers"] == r["layers"]
        summary = json.loads((figs / f"L{r['layers']}" / "pair.json").read_text())
        assert r["val_loss"] == summary["target"]["val_loss"] and r["steps"] == 12
        assert r["history"][-1]["step"] == 12 and r["history"][-1]["val_loss"] >= r["val_loss"] - 1e-9
        assert not (d / "target").exists()  # weights dropped once tabled
    assert res["shapes"][0]["params"] > res["shapes"][1]["params"]
    # the base's files were not rewritten through a hard link by a shape's build
    assert json.loads((out / "base" / "manifest" / "tokenizer.json").read_text())["build_id"] == base_tok
    assert json.loads((out / "base" / "pair.json").read_text())["target"] is None
    table = capsys.readouterr().out
    assert "| 2 |" in table and "| 1 |" in table and "+0.0000" in table


def test_a_budget_leaves_the_step_count_to_the_budget():
    base = {"target": {"layers": 28, "steps": 470, "time_budget": 165}, "drafter": {}}
    s = target_shapes.shape_settings(base, 12, 100.0, 4000)
    assert s["target"] == {"layers": 12, "steps": 4000, "time_budget": 100.0}
    assert base["target"]["layers"] == 28  # the preset's settings are not changed
    assert target_shapes.shape_settings(base, 12, None, 4000)["target"] == {"layers": 12, "steps": 470,
                                                                          "time_budget": 165}


@pytest.mark.parametrize("text", ["", "28,x", "0,4", "4,4"])
def test_bad_layer_lists_are_refused_by_name(text):
    with pytest.raises(SystemExit, match="--layers"):
        target_shapes.parse_layers(text)
