"""RoPE variants: which one a config.json asks for, and its inverse frequencies.

Hugging Face configs spell RoPE three ways: a top-level `rope_theta` (old), an added
`rope_scaling` dict (transformers 4.x), or one `rope_parameters` dict holding `rope_theta` and
`rope_type` (transformers 5). `parse_rope` reads all three with transformers' precedence
(`rope_scaling` over `rope_parameters`; a theta inside the dict over the top-level one).

The formulas follow the papers as transformers implements them (its modeling_rope_utils is
the reference the parity tests check against):
- default: inv_freq[i] = theta^(-2i/d);
- llama3 (Llama 3.1+): long wavelengths divided by `factor`, short ones kept, a smooth blend
  between `original_max_position_embeddings / low_freq_factor` and `... / high_freq_factor`;
- yarn (Qwen long context): per-dimension blend of interpolated (/factor) and extrapolated
  frequencies, ramped between the beta_fast / beta_slow correction dims, and cos/sin scaled by
  an attention factor (0.1 ln(factor) + 1 unless given).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from adaspec.errors import ConfigError

# rope_type -> keys it needs (besides rope_type / rope_theta)
SUPPORTED_ROPE_TYPES = {
    "default": (),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}


def parse_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """config.json -> (rope_theta, scaling), scaling = the rope_type and its parameters (no
    theta), None for plain RoPE. Raises ConfigError for a type we do not implement."""
    params = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"rope_parameters must be a JSON object, got {params!r}")
    theta = _number("rope_theta", params.get("rope_theta") or d.get("rope_theta") or 10000.0)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if not isinstance(rope_type, str) or rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"rope_type {rope_type!r} is not supported; adaspec implements {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if _number("partial_rotary_factor", params.get("partial_rotary_factor", d.get("partial_rotary_factor")) or 1) != 1:
        raise ConfigError("partial_rotary_factor != 1 is not supported (RoPE over the whole head only)")
    if rope_type == "default":
        return theta, None
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type", "partial_rotary_factor")}
    scaling["rope_type"] = rope_type
    # transformers: a top-level original_max_position_embeddings wins, else max_position_embeddings
    if d.get("original_max_position_embeddings") is not None:
        scaling["original_max_position_embeddings"] = d["original_max_position_embeddings"]
    scaling.setdefault("original_max_position_embeddings", d.get("max_position_embeddings", 2048))
    for k in _NUMERIC_KEYS:
        if scaling.get(k) is not None:
            _number(k, scaling[k])
    if rope_type == "yarn" and scaling.get("factor") is None:  # DeepSeek-style: the context ratio
        scaling["factor"] = _number("max_position_embeddings", d.get("max_position_embeddings", 2048)) / float(
            scaling["original_max_position_embeddings"])
    missing = [k for k in SUPPORTED_ROPE_TYPES[rope_type] if scaling.get(k) is None]
    if missing:
        raise ConfigError(f"rope_type {rope_type!r} needs {', '.join(missing)} in rope_parameters")
    return theta, scaling


_NUMERIC_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                 "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def _number(key: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(f"rope parameter {key} must be a number, got {v!r}")
    return float(v)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                  device=None) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [head_dim // 2] float64, attention scaling applied to cos/sin)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn(inv_freq, head_dim, theta, scaling)
    raise ConfigError(f"rope_type {rope_type!r} is not supported; adaspec implements {', '.join(SUPPORTED_ROPE_TYPES)}")


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen, high_freq_wavelen = old_ctx / low, old_ctx / high
    # smooth = 1 keeps a frequency, 0 divides it by factor; in between for medium wavelengths
    smooth = ((old_ctx / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    smooth = torch.where(wavelen < high_freq_wavelen, torch.ones_like(smooth), smooth)
    smooth = torch.where(wavelen > low_freq_wavelen, torch.zeros_like(smooth), smooth)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def _yarn(inv_freq: torch.Tensor, dim: int, theta: float, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    factor = float(s["factor"])
    orig = float(s["original_max_position_embeddings"])
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def correction_dim(num_rotations):  # the dimension that turns num_rotations times over orig positions
        return dim * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero, as transformers does
    ramp = ((torch.arange(dim // 2, dtype=torch.float64, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency (high-frequency dims), 0: interpolate
    inv_freq = inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
