"""Helpers for tests and examples: tiny random Hugging Face model directories, made offline.

`make_micro_model_dir` writes config.json, model.safetensors, tokenizer.json,
tokenizer_config.json and generation_config.json for a random Qwen3 or Llama model small
enough to run in milliseconds on a CPU. Nothing is downloaded.
"""
from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|mask|>", "<|im_start|>", "<|im_end|>"]

_SAMPLE_TEXT = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "import os\nimport sys\n\nclass Foo(object):\n    def __init__(self, x):\n        self.x = x\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "The quick brown fox jumps over the lazy dog. Hello world! 0123456789",
    "while True:\n    try:\n        value = next(it)\n    except StopIteration:\n        break\n",
]


def add_bos_post_processor(model_dir, token: str = "<|endoftext|>") -> int:
    """Make model_dir's tokenizer.json prepend `token` to every encoding (a Llama tokenizer's BOS,
    through a TemplateProcessing post-processor): for tests of special-token handling. -> its id."""
    path = Path(model_dir) / "tokenizer.json"
    tj = json.loads(path.read_text())
    tid = next(t["id"] for t in tj["added_tokens"] if t["content"] == token)
    tj["post_processor"] = {"type": "TemplateProcessing",
                            "single": [{"SpecialToken": {"id": token, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                            "special_tokens": {token: {"id": token, "ids": [tid], "tokens": [token]}}}
    path.write_text(json.dumps(tj))
    return tid


def make_byte_level_tokenizer(vocab_size: int = 320):
    """A byte-level BPE trained on a few lines of code: exact round trip for any text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_SAMPLE_TEXT * 4, trainer=trainer)
    return tok


def micro_config(arch: str = "qwen3", vocab_size: int = 320, **overrides) -> dict:
    cfg = dict(
        architectures=["Qwen3ForCausalLM" if arch == "qwen3" else "LlamaForCausalLM"],
        model_type=arch,
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        attention_bias=False,
        hidden_act="silu",
        bos_token_id=None,
        eos_token_id=0,
        torch_dtype="float32",
    )
    cfg.update(overrides)
    return cfg


def make_micro_model_dir(path, arch: str = "qwen3", seed: int = 0, init_std: float = 0.1,
                         mixing: float = 1.0, **overrides) -> Path:
    """Write a random micro model directory; returns its path. `overrides` edit config.json.

    mixing scales the attention and MLP output projections: 0 gives a pure bigram model (the
    next token depends on the current one only), small values a mostly-bigram one, which a
    bigram drafter (make_bigram_drafter_dir) predicts well but not perfectly."""
    import torch

    from adaspec.models.config import ModelConfig
    from adaspec.models.loader import save_pretrained
    from adaspec.models.target import TargetModel

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = make_byte_level_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    # an explicit vocab_size may be smaller than the tokenizer's (token-id-only statistical tests)
    vocab = overrides.pop("vocab_size", None) or tok.get_vocab_size()
    eos_id = tok.token_to_id("<|endoftext|>")
    cfg = ModelConfig.from_hf(micro_config(arch, vocab_size=vocab, eos_token_id=eos_id, **overrides))
    g = torch.Generator().manual_seed(seed)
    model = TargetModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                scale = mixing if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
                p.copy_(scale * init_std * torch.randn(p.shape, generator=g))
    save_pretrained(model, cfg, path)
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "mask_token": "<|mask|>",
                "model_max_length": cfg.max_position_embeddings,
            },
            indent=2,
        )
    )
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id}, indent=2))
    return path


def make_micro_drafter_dir(path, target_dir, block_size: int = 4, seed: int = 0, init_std: float = 0.1,
                           markov_rank: int = 16, num_layers: int = 1) -> Path:
    """A random DSpark drafter for a micro target (embedding / LM head copied from it)."""
    import torch

    from adaspec.models.drafter import DrafterConfig, DSparkDrafter, save_drafter
    from adaspec.models.loader import load_target
    from adaspec.models.tokenizer import Tokenizer

    target, tcfg = load_target(target_dir)
    mask_id = Tokenizer.from_dir(target_dir).token_to_id("<|mask|>")
    cfg = DrafterConfig.from_target(tcfg, mask_token_id=mask_id, block_size=block_size, num_layers=num_layers,
                                    markov_rank=markov_rank)
    g = torch.Generator().manual_seed(seed)
    model = DSparkDrafter(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if name.endswith("norm.weight")
                    else init_std * torch.randn(p.shape, generator=g))
    model.copy_from_target(target)
    return save_drafter(model, cfg, Path(path))


def make_bigram_drafter_dir(path, target_dir, block_size: int = 7, seed: int = 0) -> Path:
    """A drafter whose draft distribution is the target's BIGRAM part: base logits are zeroed
    (final norm weight 0) and the Markov head holds lm_head(norm(embed(prev))) exactly
    (rank = hidden size). Against a make_micro_model_dir(mixing=small) target it is good but
    not perfect, so steps accept some drafts and reject others."""
    import torch

    from adaspec.models.drafter import DrafterConfig, DSparkDrafter, save_drafter
    from adaspec.models.loader import load_target
    from adaspec.models.tokenizer import Tokenizer

    target, tcfg = load_target(target_dir)
    mask_id = Tokenizer.from_dir(target_dir).token_to_id("<|mask|>")
    mask_id = mask_id if mask_id < tcfg.vocab_size else tcfg.vocab_size - 1
    cfg = DrafterConfig.from_target(tcfg, mask_token_id=mask_id, block_size=block_size, num_layers=1,
                                    markov_rank=tcfg.hidden_size)
    g = torch.Generator().manual_seed(seed)
    model = DSparkDrafter(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        model.copy_from_target(target)
        model.norm.weight.zero_()  # U_j = 0: the draft is the Markov (bigram) term alone
        emb = target.model.embed_tokens.weight
        model.markov_head.markov_w1.weight.copy_(target.model.norm(emb))
        model.markov_head.markov_w2.weight.copy_(target.lm_head.weight)
    return save_drafter(model, cfg, Path(path))


def device_sync_sites(fn) -> list[str]:
    """Run fn and return "file:line" for each device-to-host sync it made on CUDA, as torch's sync
    debug mode reports them (the debug mode's own "prototype feature" warning is not a sync)."""
    import warnings

    import torch

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "called a synchronizing" in str(w.message)]


def record_proposals(drafter) -> list:
    """Wrap drafter.propose so that every proposal's (tokens, confidences) lands, as lists, in the
    returned list: tests compare what a drafter proposed under two engines."""
    out = []
    propose = drafter.propose

    def recording(*a, **kw):
        p = propose(*a, **kw)
        out.append((p.tokens.tolist(), p.confidences.tolist()))
        return p

    drafter.propose = recording
    return out


def run_waves_keeping_sequences(engine, params, waves: int = 3, per_wave: int = 4, prompt=(1, 2, 3)) -> list:
    """Run `waves` waves of `per_wave` requests with `params` to their end on `engine` (an
    LLMEngine), each wave after the last, and return every request's Sequence, all still held:
    for tests that what a finished request gives back does not wait for its Sequence to go."""
    held = []
    for wave in range(waves):
        for i in range(per_wave):
            engine.add_request(f"w{wave}-{i}", list(prompt), params)
            held.append(engine.requests[f"w{wave}-{i}"])
        while engine.has_unfinished_requests():
            engine.step()
    return held


def assert_same_proposals(want: list, got: list, atol: float = 1e-5) -> None:
    """Two record_proposals lists: the same drafts, and confidences within atol."""
    import torch

    assert len(want) == len(got), f"{len(want)} proposals against {len(got)}"
    for (tok0, conf0), (tok1, conf1) in zip(want, got):
        assert tok0 == tok1
        torch.testing.assert_close(torch.tensor(conf0), torch.tensor(conf1), atol=atol, rtol=atol)


def triton_kernels_or_skip():
    """For a test module of Triton kernels, called at its top before the kernels are imported:
    without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, numpy underneath;
    read when a kernel is decorated, at import, and again at launch, so it stays set for the
    session: harmless on a CPU-only machine, where nothing else runs Triton). Skips the module
    when triton is missing, or when its interpreter cannot run with this numpy. Returns triton."""
    import os

    import pytest
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    triton = pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        import numpy as np

        def version(v):
            return tuple(int(x) for x in v.split("+")[0].split(".")[:2])

        # triton <= 3.6's interpreter turns loop bounds into ints with int(1-element array), which
        # numpy 2.4 refuses (triton-lang/triton#9171, fixed in 3.7)
        if version(triton.__version__) < (3, 7) and version(np.__version__) >= (2, 4):
            pytest.skip(f"triton {triton.__version__}'s interpreter fails with numpy {np.__version__}: "
                        "needs triton>=3.7 for the CPU tests", allow_module_level=True)
    return triton


def load_benchmark(name: str):
    """benchmarks/NAME.py of this checkout as a module, for the tests of a script (the benchmarks
    are files beside the package, not a package; the suite runs from a checkout)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def use_eager_spec_graphs(llm, batch_sizes: list[int]):
    """Route a speculative LLM's decode steps through the graphed speculative step, its graphs
    captured eagerly (graphed_step.GraphedSpecStep.capture(eager=True): the same functions over the
    same static buffers, on the CPU). -> the GraphedSpecStep."""
    from adaspec.spec_decode.graphed_step import GraphedSpecStep

    eng = llm.llm_engine
    steps = GraphedSpecStep(eng.spec, eng, batch_sizes=batch_sizes)
    steps.capture(eager=True)
    eng.spec.use_graphs(steps)
    return steps


def no_eager_decodes(llm) -> None:
    """Make a speculative engine fail if its eager speculative step ever runs a decoding row (one
    the graphed step should have served)."""
    spec = llm.llm_engine.spec
    eager = spec._launch_eager

    def launch_eager(scheduled, *args, **kwargs):
        assert not any(s.num_tokens == 1 and s.samples for s in scheduled), "a decoding row left the graphs"
        return eager(scheduled, *args, **kwargs)

    spec._launch_eager = launch_eager


def pin_cost_tables(llm, verify_ms: tuple[float, float] = (1.0, 1.5), draft_ms: float = 0.1,
                    step_overhead_ms: float = 0.0):
    """Give an adaptive engine fixed cost tables (and a fresh policy on them) in place of those it
    profiled at startup: those are timed on the machine at hand, and on a loaded one (CI, two test
    workers on two cores) the tiny pair's drafter costs about what its target does, so they can
    make the policy skip every draft and a test that needs speculation to run sees none. These
    tables rise gently with the tokens verified (1 to 32,768 tokens: verify_ms) and price a draft
    at draft_ms, so drafting pays while the budget still drops the slots of low survival. The step
    overhead is pinned too (step_overhead_ms, in place of a configured "measured", which follows the
    steps' wall time), so no choice of the policy depends on the machine's load. -> the CostModel."""
    from dataclasses import replace

    from adaspec.spec_decode.cost_model import CostModel, CostTable

    spec = llm.llm_engine.spec
    spec.cfg = replace(spec.cfg, adaptive_verification_step_overhead_ms=step_overhead_ms)
    model = CostModel(CostTable([1, 1 << 15], list(verify_ms)), CostTable([1], [draft_ms]),
                      {w: CostTable([1], [draft_ms / 2]) for w in spec.cost_model.draft_narrow})
    spec.cost_model = model
    spec.policy = spec._make_policy()
    return model
