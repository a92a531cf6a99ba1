import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: see adaspec/__init__.py
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)
# the suite's references are float32 CPU runs: engines built without an explicit device use the
# CPU even on a GPU machine (tests/engine/test_gpu.py asks for cuda explicitly)
os.environ.setdefault("ADASPEC_DEVICE", "cpu")


@pytest.fixture(scope="session")
def micro_qwen3(tmp_path_factory):
    from adaspec.testing import make_micro_model_dir

    return make_micro_model_dir(tmp_path_factory.mktemp("micro_qwen3"), arch="qwen3", seed=0)


@pytest.fixture(scope="session")
def micro_pair(tmp_path_factory):
    """(target dir, drafter dir): a micro Qwen3 target whose next token a bigram DSpark drafter of
    block 7 predicts well, for tests of speculation through the engine."""
    from adaspec.testing import make_bigram_drafter_dir, make_micro_model_dir

    root = tmp_path_factory.mktemp("micro_pair")
    target = make_micro_model_dir(root / "target", mixing=0.02, init_std=0.3, seed=3, max_position_embeddings=256)
    return str(target), str(make_bigram_drafter_dir(root / "drafter", target, block_size=7))


@pytest.fixture(scope="session")
def micro_llama(tmp_path_factory):
    from adaspec.testing import make_micro_model_dir

    return make_micro_model_dir(tmp_path_factory.mktemp("micro_llama"), arch="llama", seed=1, tie_word_embeddings=True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _one_profile_run_per_shape():
    """An adaptive engine built by a test profiles each cost-table shape once where the default
    takes the median of 9 runs: no test judges the tables' timings (a test that needs the policy
    to draft pins its tables: adaspec.testing.pin_cost_tables), and a fresh profile of the tiny
    pair took ~28 s with 9 runs against ~4 s with one on the 2-core development machine. A test
    that names profile_repeats keeps its own. Session-scoped so that it is in place before the
    module-scoped fixtures that build engines (a function-scoped patch came after them)."""
    from adaspec.config import SpeculativeConfig

    from_dict = SpeculativeConfig.from_dict.__func__

    def with_one_run(cls, d):
        return from_dict(cls, {"profile_repeats": 1, **d} if isinstance(d, dict) else d)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SpeculativeConfig, "from_dict", classmethod(with_one_run))
        yield


_engines_built: list = []  # a weak reference to every engine the session built, in order


@pytest.fixture(scope="session", autouse=True)
def _note_every_engine():
    """Records each LLMEngine as it is built (weakly), for _free_engines_left_in_cycles."""
    import weakref

    from adaspec.engine.llm_engine import LLMEngine

    real = LLMEngine.__init__

    def noted(self, *args, **kwargs):
        _engines_built.append(weakref.ref(self))
        real(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LLMEngine, "__init__", noted)
        yield


@pytest.fixture(autouse=True)
def _free_engines_left_in_cycles():
    """After a test, a full garbage collection when an engine it built outlived it. An engine
    dies with its last reference, but a test can leave it in a reference cycle: `with
    pytest.raises(...) as e` keeps the test's frame, and with it every engine in its locals, on
    e's traceback. Each engine holds a KV cache of ~1 GiB (its drafter's another), so a worker
    that ran such tests back to back, with no full collection between them (the collector's
    oldest generation runs rarely), grew to 23.5 GB, and the kernel killed it out of memory
    (twice on the 24 GiB development machine under `-n 2`). A collection takes ~0.2 s here, so
    it runs only when it can free an engine."""
    first = len(_engines_built)
    yield
    if any(ref() is not None for ref in _engines_built[first:]):
        import gc

        gc.collect()
    del _engines_built[first:]  # dead or collected: nothing to keep
