"""Building blocks shared by the target and the drafter: RMSNorm, RoPE, SwiGLU MLP."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from adaspec.models.rope import rope_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalize in float32 like the reference implementations, cast back after
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class RotaryEmbedding(nn.Module):
    """Non-interleaved ("rotate half") RoPE, cos/sin tables precomputed once for all positions.

    `scaling` is the config's rope_type and its parameters (models/rope.py), None for plain RoPE;
    a type's attention factor (yarn) is folded into the tables."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build_tables()

    @classmethod
    def from_config(cls, cfg, max_positions: int | None = None) -> "RotaryEmbedding":
        """The one factory for a ModelConfig's RoPE (target and drafter alike)."""
        return cls(cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)

    def build_tables(self, device=None) -> None:
        """(Re)compute the tables; needed after a meta-device init, which leaves buffers empty."""
        inv_freq, attention_scaling = rope_inv_freq(self.head_dim, self.theta, self.scaling, device=device)
        t = torch.arange(self.max_positions, dtype=torch.float64, device=device)
        emb = torch.outer(t, inv_freq).repeat(1, 2)
        self.cos = (emb.cos() * attention_scaling).float()
        self.sin = (emb.sin() * attention_scaling).float()

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotate each x [..., T, H, D] by the angles of positions [..., T]."""
        cos = self.cos[positions].unsqueeze(-2)  # [..., T, 1, D]
        sin = self.sin[positions].unsqueeze(-2)
        out = []
        for x in xs:
            xf = x.float()
            x1, x2 = xf.chunk(2, dim=-1)
            rotated = torch.cat([-x2, x1], dim=-1)
            out.append((xf * cos + rotated * sin).to(x.dtype))
        return tuple(out)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
