"""`adaspec train calibrate`'s pure parts: the seeded prompt split and the cross-fitted report."""
import json

import numpy as np
import pytest

from adaspec.train.calibrate import fit_and_report, split_prompts
from adaspec.train.drafter_card import calibration_table
from adaspec.train.drafter_eval import BlockResults


def test_split_prompts_is_a_seeded_permutation():
    """Both halves sample the whole prompt file (which is in source-file order: here 10 files of
    20 prompts), not its first and second half; the same seed gives the same split."""
    a, b = split_prompts(200, seed=0)
    assert len(a) == 100 and len(b) == 100 and sorted(a + b) == list(range(200))
    assert a == sorted(a) and b == sorted(b)
    assert split_prompts(200, seed=0) == (a, b) and split_prompts(200, seed=1) != (a, b)
    files_a, files_b = {i // 20 for i in a}, {i // 20 for i in b}
    assert files_a == files_b == set(range(10))
    assert 35 <= sum(i < 100 for i in a) <= 65  # about half of A from the file's first half
    a, b = split_prompts(7, seed=3)
    assert len(a) == 3 and len(b) == 4 and sorted(a + b) == list(range(7))
    assert split_prompts(1, seed=0) == ([], [0])


def _halves(n, true_temperature, seed):
    """Two BlockResults whose slot j is accepted with probability sigmoid(z_j / true_temperature)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(2):
        z = rng.normal(1.0, 1.5, (n, 4))
        p = 1 / (1 + np.exp(-z / true_temperature))
        acc = rng.random((n, 4)) < p
        out.append(BlockResults(z, p, np.where(acc.all(1), 4, np.argmin(acc, axis=1)), 1.0))
    return out


# calibrated (the seed pins a case the rule keeps; calibrated data is adopted by chance in about
# one seed in five) and twice too sharp: the two branches of the report
@pytest.mark.parametrize("true_temperature, seed, adopted", [(1.0, 1, False), (2.0, 0, True)])
def test_report_is_out_of_fold_and_after_is_what_is_saved(true_temperature, seed, adopted):
    """after = the figures of the temperatures saved: the out-of-fold fit's when adopted, raw
    when not (temperatures 1.0); before is raw on the same halves. The JSON says which."""
    a, b = _halves(2000, true_temperature, seed=seed)
    out = fit_and_report(a, b)
    curves = out.pop("_curves")
    assert len(curves) == 2
    json.dumps(out)  # what `train calibrate` writes
    assert out["adopted"] is adopted and out["reason"]
    assert len(out["folds"]) == 2 and [f["rows"] for f in out["folds"]] == [2000, 2000]
    assert out["before"]["ece"] == pytest.approx(np.mean([f["ece_raw"] for f in out["folds"]]))
    assert out["fitted"]["ece"] == pytest.approx(np.mean([f["ece_fitted"] for f in out["folds"]]))
    if out["adopted"]:
        assert out["after"] == out["fitted"] and out["after"]["ece"] < 0.5 * out["before"]["ece"]
        assert out["temperatures"] == out["fitted_temperatures"]
    else:
        assert out["after"] == out["before"] and out["temperatures"] == [1.0] * 4
        assert out["fitted"]["ece"] >= out["before"]["ece"]
    # the card shows the decision and the fitted temperatures beside the saved ones
    out.update(fit_blocks=2000, report_blocks=2000)
    table = "\n".join(calibration_table(out, "T = 1"))
    assert ("| adopted |" if out["adopted"] else "| not adopted |") in table and "| ECE fitted |" in table
