"""adaspec: LLM inference with confidence-scheduled (adaptive) speculative decoding."""
from adaspec.sampling_params import SamplingParams
from adaspec.outputs import CompletionOutput, RequestOutput

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name):  # lazy: importing adaspec must not import torch
    if name == "LLM":
        from adaspec.llm import LLM

        return LLM
    raise AttributeError(name)
