"""The built-in model of `python -m qtensor demo` and `analyze`: a small Llama-style transformer.

Everything is defined here, so the demo needs no download and no optional package: RMSNorm,
rotary attention with grouped-query heads, a SwiGLU MLP and an untied (or tied) LM head. Every
nn.Linear has in_features and out_features that are multiples of 32, so every format applies
(NVFP4 blocks are 16 wide, MXFP8 blocks 32). Weights are drawn from a seeded generator, so
two builds with one seed are bit-identical.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Sizes of the built-in transformer. Validated at construction."""

    vocab_size: int = 2048
    hidden: int = 256
    layers: int = 2
    heads: int = 8
    kv_heads: int = 4  # grouped-query attention: each k/v head serves heads // kv_heads q heads
    intermediate: int = 704  # SwiGLU width, ~2.75x hidden like Llama, rounded to a multiple of 32
    tie_embeddings: bool = False  # share the embedding matrix with the LM head
    rope_theta: float = 10000.0
    eps: float = 1e-5

    def __post_init__(self):
        for name in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "intermediate"):
            if getattr(self, name) < 1:
                raise ValueError(f"DemoConfig.{name} must be positive; got {getattr(self, name)}.")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError(
                f"DemoConfig needs hidden divisible by heads into an even head dim (rotary "
                f"pairs); got hidden={self.hidden}, heads={self.heads}."
            )
        if self.heads % self.kv_heads:
            raise ValueError(
                f"DemoConfig needs heads divisible by kv_heads; got {self.heads} and "
                f"{self.kv_heads}."
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 (bf16 sums of squares lose ~3 digits at hidden=4096), cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rotary_tables(seq: int, head_dim: int, theta: float,
                  device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [seq, head_dim / 2] of the rotary embedding, in fp32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(seq, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (first half, second half) pairs of x [B, H, T, D] (the Llama convention)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class DemoTransformer(nn.Module):
    """Token ids [B, T] -> logits [B, T, vocab]."""

    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cos, sin = rotary_tables(tokens.shape[1], self.config.head_dim, self.config.rope_theta,
                                 tokens.device)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))


def _init_weights(model: DemoTransformer, generator: torch.Generator) -> None:
    """Llama-style init: N(0, 0.02); residual outputs (o_proj, down_proj) scaled by 1/sqrt(2L)."""
    residual_std = 0.02 / math.sqrt(2 * model.config.layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                # Norm gains spread around 1 (a trained model's are far from all-ones); this
                # gives the activations per-channel scale differences for the formats to meet.
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=generator).abs())
            else:
                std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=generator) * std)


def build_demo_model(
    cfg: DemoConfig = DemoConfig(), *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
) -> DemoTransformer:
    """The demo transformer with seeded weights, in eval mode."""
    generator = torch.Generator().manual_seed(seed)
    model = DemoTransformer(cfg)
    _init_weights(model, generator)
    return model.to(device=device, dtype=dtype).eval()


def demo_tokens(cfg: DemoConfig, batch: int, seq: int, *, seed: int = 0,
                device="cpu") -> torch.Tensor:
    """A fixed batch of token ids [batch, seq]."""
    generator = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=generator)
    return tokens.to(device)


__all__ = ["DemoConfig", "DemoTransformer", "build_demo_model", "demo_tokens"]
