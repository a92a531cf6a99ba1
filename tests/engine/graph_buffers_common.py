"""What the CPU tests of the CUDA-graph buffers share (test_graph_buffers.py, and its speculative half
test_graph_buffers_spec.py: two files so that the suite's two workers share the Triton interpreter's
work): the interpreter switched on without CUDA, a micro target and drafter, engines with graphs
captured eagerly over their static buffers, prompts. The eager engines the graphed ones must equal
run the reference attention backend (pure torch: a fraction of a second where the interpreter takes
seconds per step); the Triton kernel itself is checked against it in
tests/models/test_paged_attention_triton.py, through the engine too."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from adaspec import LLM, SamplingParams  # noqa: E402
from adaspec.engine.cuda_graphs import GraphedForward  # noqa: E402
from adaspec.testing import make_micro_drafter_dir, make_micro_model_dir  # noqa: E402

# for the test modules: their engines run on the CPU, so the Triton kernels need the interpreter; on
# a CUDA machine it is off (a CUDA launch with CPU tensors fails: H100 run 70) and
# tests/engine/test_cuda_graphs_gpu.py runs these paths on the GPU instead
needs_kernels = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the engines here run on the CPU: needs Triton's interpreter (TRITON_INTERPRET=1)")


def make_pair(tmp_path_factory):
    """A micro target and its drafter (the test modules' module-scoped `pair` fixture). One kv head
    (4 query heads on it): the kernel's grid has a program per (query tile, kv head), and each
    program costs the interpreter ~80 ms, so a second kv head nearly doubled these tests' time
    without checking more of the buffer logic (the kernel's GQA with several kv heads is checked
    in tests/models/test_paged_attention_triton.py)."""
    root = tmp_path_factory.mktemp("graphs")
    target = make_micro_model_dir(root / "t", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=1, init_std=0.3, seed=3,
                                  max_position_embeddings=128)
    drafter = make_micro_drafter_dir(root / "d", target, block_size=4, init_std=0.3, markov_rank=8, seed=4)
    return str(target), str(drafter)


def _engine(pair, graphs: bool, spec: bool, async_scheduling: bool = False, backend: str = "triton"):
    cfg = {"method": "dspark", "model": pair[1], "num_speculative_tokens": 3} if spec else None
    llm = LLM(pair[0], speculative_config=cfg, attention_backend=backend, max_num_seqs=12, device="cpu",
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


def _prompts(n):
    g = torch.Generator().manual_seed(n)
    return [torch.randint(1, 64, (int(L),), generator=g).tolist() for L in torch.randint(3, 20, (n,), generator=g)]


def check_graph_buffers_match_eager(pair, spec: bool) -> None:
    # different max_tokens: requests finish at different steps, so batches shrink through
    # sizes that pad (11 -> 12, 5 -> 8, 3 -> 4) and drafts are capped near max_tokens (l_r < k).
    # Decode: one request fewer per step; speculation: one per two steps, so that request 8 lives
    # to its 19th token, where this random pair accepts its one draft
    prompts = _prompts(11)
    stride = 2 if spec else 1
    params = [SamplingParams(temperature=0, max_tokens=3 + stride * i, ignore_eos=True) for i in range(11)]
    eager = _engine(pair, graphs=False, spec=spec, backend="reference")
    graphed = _engine(pair, graphs=True, spec=spec)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
    assert got == want
    runner = graphed.llm_engine.runner
    assert runner.num_graph_steps > 5 and runner.num_eager_steps >= 1  # prefill eager, decodes graphed
    if spec:
        st = graphed.llm_engine.stats
        assert st.num_verified_tokens > 0 and st.num_accepted_tokens > 0
