"""Shared setup of the CUDA-graph buffer tests (test_graph_buffers.py, test_graph_buffers_mixed.py):
on CPU they run the Triton kernel in its interpreter, which must be chosen before triton is
imported; two files so that the two test workers share their ~6 minutes."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from adaspec import LLM  # noqa: E402
from adaspec.engine.cuda_graphs import GraphedForward  # noqa: E402

needs_triton = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                  reason="needs CUDA or Triton's interpreter")


def graphed_engine(pair, graphs: bool, spec: bool, async_scheduling: bool = False):
    cfg = {"method": "dspark", "model": pair[1], "num_speculative_tokens": 3} if spec else None
    llm = LLM(pair[0], speculative_config=cfg, attention_backend="triton", max_num_seqs=12, device="cpu",
              skip_tokenizer_init=True, async_scheduling=async_scheduling)
    eng = llm.llm_engine
    if graphs:
        k = 3 if spec else 0
        g = GraphedForward(eng.model, eng.kv_caches, eng.config.block_size, eng.device, eng.config.max_num_seqs,
                           query_lens=(1, k + 1) if k else (1,), max_model_len=eng.max_model_len,
                           max_blocks_per_seq=-(-(eng.max_model_len + 4) // eng.config.block_size),
                           scratch_block=eng.scratch_block,
                           capture_layers=list(eng.spec.capture_layers) if spec else None)
        g.capture(eager=True)
        eng.runner.graphs = g
    return llm


def prompt_ids(n):
    g = torch.Generator().manual_seed(n)
    return [torch.randint(1, 64, (int(L),), generator=g).tolist() for L in torch.randint(3, 20, (n,), generator=g)]
