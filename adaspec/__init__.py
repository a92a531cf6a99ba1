"""adaspec: LLM inference with confidence-scheduled (adaptive) speculative decoding."""
import os as _os

# OpenMP threads that spin while waiting collapse CPU throughput 10-20x as soon as another
# process (a benchmark client, a second server, the test runner) competes for the cores: seen
# on the 2-core developer machines (tiny, batch 16: 45 -> 1070 tok/s with PASSIVE). It must be
# set before torch initializes OpenMP, hence here, before anything imports torch.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from adaspec.sampling_params import RequestOutputKind, SamplingParams
from adaspec.outputs import CompletionOutput, RequestOutput
from adaspec.inputs import TextPrompt, TokensPrompt

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput", "TextPrompt",
           "TokensPrompt", "__version__"]


def __getattr__(name):  # lazy: importing adaspec must not import torch
    if name == "LLM":
        from adaspec.llm import LLM

        return LLM
    raise AttributeError(name)
