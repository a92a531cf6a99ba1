"""Speculative decoding (vLLM names this folder spec_decode too). Import the submodules directly:

- step.py: the speculative step (``SpeculativeDecoder``): draft, choose verified lengths, ONE
  target forward, lossless acceptance (adaspec/sample/rejection.py), KV commit.
- graphed_step.py: the step's decode path as CUDA graphs (propose, verify-and-accept, one read back).
- pipelined.py: pipelined steps (step t + 1 launched before step t is read back; the engine's loop
  is ``LLMEngine._pipelined_spec_step``).
- policy.py: survivals, ``choose_budget`` (B* over all B), ``allocate`` / ``allocate_torch``
  (top-B prefixes), ``AdaptiveBudget`` (B* from one-step-old confidences: lossless; the
  module docstring has the argument), ``apply_temperature``, and the engine-facing
  ``FixedPolicy`` / ``AdaptivePolicy``.
- cost_model.py: ``CostTable`` / ``CostModel`` (VERIFY.md lookup rules), ``profile``, grids,
  ``load_or_profile`` (keyed JSON disk cache), ``plot_cost_model``.
- profiler.py: the startup profiling of dummy verify and draft steps that fills the tables.
- calibration.py: ``ece``, ``auc``, ``sequential_temperature_scaling``, reliability plot,
  ``CalibrationTracker`` (online predicted vs realized acceptance per slot position).
"""
