"""`"method": "synthetic"` (spec_decode/synthetic.py): acceptance drawn from a configured curve,
confidences = curve + noise, bad configs refused by key, and the engine carries its label."""
import math

import numpy as np
import pytest
import torch

from adaspec.config import SpeculativeConfig
from adaspec.errors import ConfigError
from adaspec.spec_decode.synthetic import LABEL, accepted_prefix, synthetic_accept, synthetic_confidences

# distinct neighbours, so a draw keyed to the wrong position shows up as a wrong rate
CURVE = [0.9, 0.5, 0.8, 0.3, 0.6, 0.95, 0.4]


def _keys(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    seeds = torch.randint(0, 1 << 62, (n,), generator=g)
    anchors = torch.randint(0, 4000, (n,), generator=g)
    return seeds, anchors


def _conditional_rates(n_acc: np.ndarray, num_verify: np.ndarray, k: int):
    """Per position j: (slots reached = verified with drafts < j accepted, of which accepted)."""
    reached = np.array([np.sum((n_acc >= j) & (num_verify > j)) for j in range(k)])
    passed = np.array([np.sum(n_acc >= j + 1) for j in range(k)])
    return reached, passed


@pytest.mark.parametrize("truncate", [False, True])
def test_realized_conditional_acceptance_matches_the_curve(truncate):
    n, k = 100_000, len(CURVE)
    seeds, anchors = _keys(n)
    g = torch.Generator().manual_seed(1)
    num_verify = torch.randint(0, k + 1, (n,), generator=g) if truncate else torch.full((n,), k)
    n_acc = accepted_prefix(torch.tensor(CURVE), num_verify, seeds, anchors).numpy()
    nv = num_verify.numpy()
    assert (n_acc <= nv).all() and (n_acc >= 0).all()
    reached, passed = _conditional_rates(n_acc, nv, k)
    for j, c in enumerate(CURVE):
        assert reached[j] > 500, "too few draws to test the position"
        sigma = math.sqrt(c * (1 - c) / reached[j])
        rate = passed[j] / reached[j]
        assert abs(rate - c) < 4 * sigma, f"position {j}: realized {rate:.4f}, configured {c} (4 sigma = {4 * sigma:.4f})"


def test_draws_are_keyed_reproducible_and_batch_independent():
    seeds, anchors = _keys(64)
    curve = torch.tensor(CURVE)
    nv = torch.full((64,), len(CURVE))
    a = accepted_prefix(curve, nv, seeds, anchors)
    assert torch.equal(a, accepted_prefix(curve, nv, seeds, anchors))
    # a row's result does not depend on its batch neighbours
    assert torch.equal(a[10:20], accepted_prefix(curve, nv[10:20], seeds[10:20], anchors[10:20]))
    # certain and impossible positions
    ones = accepted_prefix(torch.ones(4), torch.full((64,), 4), seeds, anchors)
    assert (ones == 4).all()
    zero_at_2 = accepted_prefix(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.full((64,), 4), seeds, anchors)
    assert (zero_at_2 == 2).all()


def test_emits_accepted_drafts_then_the_targets_token():
    n, k, V = 6, 4, 11
    seeds, anchors = _keys(n, seed=3)
    drafts = torch.randint(0, V, (n, k), generator=torch.Generator().manual_seed(2))
    num_verify = torch.tensor([4, 4, 2, 0, 3, 4])
    curve = torch.tensor([1.0, 1.0, 0.0, 1.0])  # stops at slot 2 unless verification stops earlier
    # the target puts all mass on token (5 + slot): greedy and sampled rows must both emit it
    p = torch.zeros(n, k + 1, V)
    for j in range(k + 1):
        p[:, j, 5 + j] = 1.0
    greedy = torch.tensor([True, False, True, False, True, False])
    out = synthetic_accept(curve, drafts, num_verify, p, greedy, seeds, anchors)
    exp_acc = torch.minimum(num_verify, torch.tensor(2))
    assert torch.equal(out.num_accepted, exp_acc) and torch.equal(out.num_emitted, exp_acc + 1)
    for r in range(n):
        a = int(exp_acc[r])
        assert out.output_tokens[r, :a].tolist() == drafts[r, :a].tolist()
        assert int(out.output_tokens[r, a]) == 5 + a
        assert (out.output_tokens[r, a + 1:] == -1).all()


def test_confidences_are_the_curve_plus_clipped_noise():
    n, k = 20_000, len(CURVE)
    seeds, anchors = _keys(n, seed=5)
    curve = torch.tensor(CURVE)
    exact = synthetic_confidences(curve, 0.0, seeds, anchors, k)
    assert torch.allclose(exact, curve.expand(n, k))
    c = synthetic_confidences(curve, 0.05, seeds, anchors, k)
    assert c.min() >= 0 and c.max() <= 1 and c.shape == (n, k)
    assert torch.equal(c, synthetic_confidences(curve, 0.05, seeds, anchors, k))  # keyed
    mid = [j for j, x in enumerate(CURVE) if 0.2 <= x <= 0.8]  # far from the clip
    dev = (c - curve)[:, mid]
    assert dev.mean().abs() < 4 * 0.05 / math.sqrt(dev.numel())
    assert abs(float(dev.std()) - 0.05) < 0.002
    # the noise is not the accept draw: confidences do not predict acceptance beyond the curve
    acc = accepted_prefix(curve, torch.full((n,), k), seeds, anchors) >= 2  # slot 1 accepted
    reached = accepted_prefix(curve, torch.full((n,), k), seeds, anchors) >= 1
    corr = np.corrcoef(c[reached, 1].numpy(), acc[reached].float().numpy())[0, 1]
    assert abs(corr) < 0.05


def _spec(**kw):
    return SpeculativeConfig.from_dict({"method": "synthetic", "synthetic_acceptance": CURVE, **kw})


def test_good_synthetic_config_parses():
    c = _spec(num_speculative_tokens=5, synthetic_confidence_noise=0, synthetic_drafter={"num_layers": 2})
    assert c.method == "synthetic" and c.synthetic_acceptance == CURVE and c.synthetic_drafter == {"num_layers": 2}
    assert SpeculativeConfig.from_dict({"method": "synthetic", "synthetic_acceptance": [1, 0]}).synthetic_confidence_noise == 0.05


@pytest.mark.parametrize("cfg, needle", [
    ({"synthetic_acceptance": None}, "needs \"synthetic_acceptance\""),
    ({"synthetic_acceptance": [0.5, 1.5]}, "synthetic_acceptance must hold numbers in \\[0, 1\\]; position 1 is 1.5"),
    ({"synthetic_acceptance": [0.5, "0.4"]}, "synthetic_acceptance .* position 1"),
    ({"synthetic_acceptance": [True]}, "synthetic_acceptance .* position 0"),
    ({"synthetic_acceptance": [float("nan")]}, "synthetic_acceptance .* position 0"),
    ({"synthetic_acceptance": []}, "synthetic_acceptance must be a non-empty list"),
    ({"synthetic_acceptance": 0.5}, "synthetic_acceptance must be a non-empty list"),
    ({"synthetic_acceptance": [0.5, 0.5], "num_speculative_tokens": 3}, "synthetic_acceptance has 2 values"),
    ({"synthetic_confidence_noise": -0.1}, "synthetic_confidence_noise must be a number >= 0"),
    ({"synthetic_drafter": {"num_layer": 1}}, "unknown synthetic_drafter key.*num_layer"),
    ({"synthetic_drafter": {"num_layers": 0}}, "synthetic_drafter.num_layers must be a positive integer"),
    ({"synthetic_drafter": [1]}, "synthetic_drafter must be a JSON object"),
    ({"synthetic_drafter": {"num_layers": 1}, "model": "tiny-dspark"}, "either \"model\""),
])
def test_bad_synthetic_configs_name_the_key(cfg, needle):
    with pytest.raises(ConfigError, match=needle):
        SpeculativeConfig.from_dict({"method": "synthetic", "synthetic_acceptance": CURVE, **cfg})


@pytest.mark.parametrize("key, value", [("synthetic_acceptance", [0.5]), ("synthetic_confidence_noise", 0.1),
                                        ("synthetic_drafter", {"num_layers": 1})])
def test_synthetic_keys_need_the_synthetic_method(key, value):
    with pytest.raises(ConfigError, match=f"{key} need \"method\": \"synthetic\""):
        SpeculativeConfig.from_dict({"method": "dspark", key: value})


def test_label_text():
    assert LABEL == "synthetic acceptance: timing only"
