"""Sampling, the bottom layer that models and engine both import (models never import engine):

- probs.py: ``processed_probs`` (THE distribution a request samples from: temperature, top-k,
  top-p; one-hot for greedy) and ``logprobs_of``;
- random.py: keyed (counter-based) uniforms per (seed, position, purpose) and inverse-CDF
  ``sample_categorical``: reproducible per request whatever the batch, graph-capturable;
- batch.py: ``SamplingBatch``, a step's sampling tensors built once from the requests' params;
- rejection.py: ``rejection_sample``, lossless acceptance of drafts with the bonus token.
"""
