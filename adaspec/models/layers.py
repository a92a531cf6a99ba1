"""Building blocks shared by the target and the drafter: embeddings, RMSNorm, RoPE, SwiGLU MLP."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from adaspec.models.fused import ops
from adaspec.models.rope import rope_inv_freq


def embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding, without its normal_ init when built on the meta device (the loaders build
    models there, then load the weights): a meta normal_ runs through torch._refs, whose first call
    imports torch._dynamo, ~2.5 s of CPU in every process that loads a model (each server, TP
    worker and CLI). Anywhere else the init is nn.Embedding's own, so trained models are unchanged."""
    if torch.empty(0).device.type == "meta":  # the device a bare factory call lands on now
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalize in float32 like the reference implementations, cast back after
        return ops.rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Non-interleaved ("rotate half") RoPE, cos/sin tables precomputed once for all positions.

    `scaling` is the config's rope_type and its parameters (models/rope.py), None for plain RoPE;
    a type's attention factor (yarn) is folded into the tables."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        if self.cos.device.type != "meta":
            # on meta the tables would be empty anyway (every loader rebuilds them on the real device),
            # and meta arange runs through torch._refs, which imports torch._dynamo (see embedding)
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
        self.gate_up_weight: torch.Tensor | None = None  # set by fuse()

    @torch.no_grad()
    def fuse(self) -> None:
        """One [2I, d] weight for gate and up (one matmul instead of two); the two Linear weights
        become views into it, so checkpoints keep Hugging Face's names and nothing is duplicated."""
        self.gate_up_weight, (self.gate_proj.weight, self.up_proj.weight) = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is not None:
            return self.down_proj(ops.silu_mul(F.linear(x, self.gate_up_weight)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, list[nn.Parameter]]:
    """Concatenate bias-free Linear weights along the output dim -> (fused, per-Linear views)."""
    fused = torch.cat([m.weight.detach() for m in linears]).contiguous()
    views, start = [], 0
    for m in linears:
        n = m.weight.shape[0]
        views.append(nn.Parameter(fused[start:start + n], requires_grad=False))
        start += n
    return fused, views
