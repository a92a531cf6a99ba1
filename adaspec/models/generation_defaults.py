"""A model's own sampling defaults, from its generation_config.json (vLLM's generation_config
"auto"): the values its authors recommend (Qwen3: temperature 0.6, top_p 0.95, top_k 20) become
the defaults of a request that does not set them, offline (`LLM.generate` without sampling
params, `LLM.get_default_sampling_params`) and in the server (a field left out or null).

vLLM reads the same keys, repetition_penalty and min_p included (sample/logits_rules.py). A
recommended value of a field adaspec cannot sample with would be dropped, and the engine says so at
load (none of KEYS is such a field today)."""
from __future__ import annotations

import json
from pathlib import Path

from adaspec.errors import ConfigError
from adaspec.sampling_params import UNSUPPORTED_UNLESS, is_neutral

# generation_config.json key -> SamplingParams field (vLLM's get_diff_sampling_param)
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_generation_defaults(model_dir: str | Path, setting: str = "auto") -> tuple[dict, dict]:
    """-> (defaults adaspec applies, recommended values it cannot and drops). setting: "auto" (the
    model directory's file), "vllm" (none: SamplingParams' own defaults), or a directory holding
    a generation_config.json."""
    if setting == "vllm":
        return {}, {}
    folder = Path(model_dir) if setting == "auto" else Path(setting)
    if setting != "auto" and not (folder / "generation_config.json").is_file():
        raise ConfigError(f"generation_config {setting!r}: no generation_config.json there (use \"auto\", "
                          "\"vllm\" or a directory holding one)")
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}, {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    applied, dropped = {}, {}
    for key, field in KEYS.items():
        v = raw.get(key) if isinstance(raw, dict) else None
        if v is None:
            continue
        if field in UNSUPPORTED_UNLESS and not is_neutral(v, UNSUPPORTED_UNLESS[field]):
            dropped[field] = v
        else:
            applied[field] = v
    return applied, dropped
