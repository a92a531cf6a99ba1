"""Load and save Hugging Face model directories (config.json + safetensors, sharded or not)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from adaspec.errors import ModelLoadError
from adaspec.models.config import ModelConfig
from adaspec.models.registry import (drafter_as_target_message, is_drafter_config, missing_model_message,
                                     resolve_model_path)


def read_json(path: Path, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ModelLoadError(f"{what} not found: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{what} is not valid JSON ({path}): {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{what} must hold a JSON object: {path}")
    return data


def model_dir(name_or_path: str | Path) -> Path:
    path = resolve_model_path(name_or_path)
    if not path.is_dir():
        raise ModelLoadError(missing_model_message(name_or_path, path))
    return path


def load_config(path: Path) -> ModelConfig:
    return ModelConfig.from_hf(read_json(path / "config.json", "config.json"))


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, or the shards named by model.safetensors.index.json."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.exists():
        files = [single]
    elif index.exists():
        weight_map = read_json(index, "model.safetensors.index.json").get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index} has no weight_map")
        files = [path / f for f in sorted(set(weight_map.values()))]
    else:
        raise ModelLoadError(f"no model.safetensors or model.safetensors.index.json in {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except FileNotFoundError:
            raise ModelLoadError(f"weight shard missing: {f}") from None
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"corrupt weights file {f}: {e}") from None
    return state


def load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], path: Path, allow_missing=()) -> None:
    own = model.state_dict()
    missing = [k for k in own if k not in state and k not in allow_missing]
    if missing:
        raise ModelLoadError(f"weights in {path} lack {len(missing)} tensor(s), e.g. {missing[:3]}")
    for name, tensor in state.items():
        if name not in own:
            continue  # e.g. rotary inv_freq buffers some exporters write
        if own[name].shape != tensor.shape:
            raise ModelLoadError(
                f"tensor {name} in {path} has shape {tuple(tensor.shape)}, config implies {tuple(own[name].shape)}"
            )
        with torch.no_grad():
            own[name].copy_(tensor)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


LOAD_FORMATS = ("auto", "safetensors", "dummy")


def init_dummy_weights(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights in place, on whatever device the model lives (vLLM's load_format="dummy"):
    N(0, std) for matrices and embeddings, 1 for norm weights, 0 for biases. Only for timing
    real architectures without their checkpoints: the outputs mean nothing."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
            else:
                p.normal_(0.0, std, generator=gen)


def load_target(name_or_path, dtype=None, device="cpu", load_format: str = "auto", shard=None):
    """-> (TargetModel in eval mode on `device`, ModelConfig). load_format "dummy": random
    weights of the configured shape, built directly on `device` (the directory needs only
    config.json). shard: called on the model before it reaches `device` (tensor parallelism keeps
    only its shard there)."""
    from adaspec.models.target import TargetModel

    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {load_format!r}")
    device = torch.device(device)
    path = model_dir(name_or_path)
    raw = read_json(path / "config.json", "config.json")
    if is_drafter_config(raw):
        raise ModelLoadError(drafter_as_target_message(name_or_path, path))
    cfg = ModelConfig.from_hf(raw)
    if load_format == "dummy":
        with torch.device("meta"):
            model = TargetModel(cfg)
        if shard is not None:
            shard(model)
        # dtype first, on meta: an 8B model never exists in float32 on the device
        model = model.to(dtype=resolve_dtype(dtype, device)).to_empty(device=device)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        init_dummy_weights(model)
        model.rope.build_tables(device=device)
        return model.eval(), cfg
    state = load_state_dict(path)
    with torch.device("meta"):
        model = TargetModel(cfg)
    model = model.to_empty(device="cpu")
    model.rope.build_tables(device="cpu")  # buffers are not in the checkpoint
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    load_weights(model, state, path, allow_missing=("lm_head.weight",) if cfg.tie_word_embeddings else ())
    if shard is not None:
        shard(model)
    model = model.to(device=device, dtype=resolve_dtype(dtype, device)).eval()
    model.rope.build_tables(device=device)  # keep RoPE tables in float32 whatever the weights' dtype
    return model, cfg


def save_pretrained(model, cfg: ModelConfig, out_dir, dtype: torch.dtype | None = None) -> Path:
    """config.json + model.safetensors (a tied lm_head is not written, as HF does)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for k, v in model.state_dict().items():
        if cfg.tie_word_embeddings and k == "lm_head.weight":
            continue
        t = v.detach().to("cpu")
        state[k] = (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = cfg.to_hf()
    if dtype is not None:
        hf["torch_dtype"] = str(dtype).replace("torch.", "")
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return out
