"""Engine-independent pieces of speculative decoding: lossless acceptance (rejection.py),
the adaptive verification budget (policy.py), step-cost tables (cost_model.py) and
confidence calibration (calibration.py). Import the submodules directly."""
