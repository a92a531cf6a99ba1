"""`bench report` on what an interrupted or odd sweep leaves: cells with fewer repeats than the
others (no spread from one repeat: never "beyond spread"), and point files missing a key."""
import json

import pytest

from adaspec.bench.report import write_report
from adaspec.cli import main
from adaspec.errors import AdaspecError


def _write(d, arm, c, r, thr, speed, **extra):
    p = {"arm": arm, "concurrency": c, "repeat": r, "complete": True, "completed": 4, "failed": 0,
         "output_throughput": thr, "median_per_user_tok_s": speed, **extra}
    (d / "points").mkdir(exist_ok=True)
    (d / "points" / f"{arm.replace(':', '-')}_c{c}_r{r}.json").write_text(json.dumps(p))


def _verdict(md, c):
    return next(line for line in md.splitlines() if line.startswith(f"- **C={c}**"))


def test_a_one_repeat_cell_is_flagged_and_never_dominated_beyond_spread(tmp_path):
    # none: 3 repeats at C=1 and C=4; fixed:7 was cut short at C=1 after one repeat, far below none
    for r in range(3):
        _write(tmp_path, "none", 1, r, 100.0 + r, 50.0 + r)
        _write(tmp_path, "none", 4, r, 300.0 + r, 30.0 + r)
        _write(tmp_path, "fixed:7", 4, r, 200.0 + r, 20.0 + r)
    _write(tmp_path, "fixed:7", 1, 0, 80.0, 40.0)
    md = write_report(tmp_path)["markdown"]
    # with 3 repeats on both sides: dominated beyond spread, as before
    assert "dominated beyond spread: `fixed:7` (by `none`)." in _verdict(md, 4)
    # the one-repeat cell has no spread: listed apart, not as dominated beyond spread
    c1 = _verdict(md, 1)
    assert "dominated beyond spread: none." in c1
    assert "Worse on both axes, spread unknown (a cell with fewer than 2 repeats): `fixed:7` (by `none`)." in c1
    # and the tables and warnings say it has fewer repeats
    assert "| 1 | 80.0 (1 of 3 repeats) | 101.0 ± 1.00 |" in md  # arms in file order: fixed:7, none
    assert "| 1 | 40.0 (1 of 3 repeats) | 51.0 ± 1.00 |" in md
    assert "- cells with fewer repeats than the others' 3: fixed:7 at C=1 (1)." in md
    assert "no dominance beyond spread is claimed by or against it" in md


def test_a_one_repeat_sweep_claims_nothing_beyond_spread(tmp_path):
    _write(tmp_path, "none", 1, 0, 100.0, 50.0)
    _write(tmp_path, "fixed:7", 1, 0, 80.0, 40.0)
    md = write_report(tmp_path)["markdown"]
    assert "dominated beyond spread: none. Worse on both axes, spread unknown" in _verdict(md, 1)
    assert "(1 of" not in md and "cells with fewer repeats" not in md  # every cell has the sweep's one repeat


def test_a_point_without_its_concurrency_is_named(tmp_path, capsys):
    _write(tmp_path, "none", 1, 0, 100.0, 50.0)
    bad = tmp_path / "points" / "none_c2_r0.json"
    bad.write_text(json.dumps({"arm": "none", "repeat": 0, "complete": True, "output_throughput": 1.0}))
    with pytest.raises(AdaspecError, match=r"none_c2_r0\.json: a complete point without the key 'concurrency'"):
        write_report(tmp_path)
    assert main(["bench", "report", str(tmp_path)]) == 2
    assert "without the key 'concurrency'" in capsys.readouterr().err
    bad.write_text(json.dumps({"concurrency": 2, "repeat": 0, "complete": True}))
    with pytest.raises(AdaspecError, match=r"none_c2_r0\.json: a complete point without the key 'arm'"):
        write_report(tmp_path)
    bad.write_text(json.dumps({"arm": "none", "concurrency": "two", "complete": True}))
    with pytest.raises(AdaspecError, match=r"none_c2_r0\.json: 'concurrency' is 'two', not a whole number"):
        write_report(tmp_path)
