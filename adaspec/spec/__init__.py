"""Engine-independent pieces of speculative decoding (the rejection sampler lives in adaspec/sample/).
Import the submodules directly:

- policy.py: survivals, ``choose_budget`` (B* over all B), ``allocate`` / ``allocate_torch``
  (top-B prefixes), ``AdaptiveBudget`` (B* from one-step-old confidences: lossless; the
  module docstring has the argument), ``apply_temperature`` (calibration temperatures).
- cost_model.py: ``CostTable`` / ``CostModel`` (VERIFY.md lookup rules), ``profile``, grids,
  ``load_or_profile`` (keyed JSON disk cache), ``plot_cost_model``.
- calibration.py: ``ece``, ``auc``, ``sequential_temperature_scaling``, reliability plot,
  ``CalibrationTracker`` (online predicted vs realized acceptance per slot position).
"""
