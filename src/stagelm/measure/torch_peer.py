"""The peer a user would otherwise pick: the same decoder in plain PyTorch, timed like ours.

Imported by the benchmark stage only with `benchmark.torch_peer: true` (torch is never a
dependency of stagelm): a float32 train step (AdamW, the same loss) and greedy decoding with a
preallocated KV cache, on the benchmark section's shape, random weights and tokens.
"""

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stagelm.measure.timing import timed


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


class Rotary:
    """Rotate-half RoPE tables for positions up to `longest`."""

    def __init__(self, head_dim: int, longest: int):
        freqs = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.arange(longest, dtype=torch.float32)[:, None] * freqs[None]
        self.cos, self.sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        self.half = head_dim // 2

    def __call__(self, x: torch.Tensor, start: int) -> torch.Tensor:  # x: (B, heads, T, hd)
        t = x.shape[2]
        x1, x2 = x[..., : self.half], x[..., self.half :]
        return x * self.cos[start : start + t] + torch.cat([-x2, x1], -1) * self.sin[start : start + t]


class Block(nn.Module):
    def __init__(self, cfg: Any, rope: Rotary):
        super().__init__()
        d, self.h, self.kv, self.hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_model // cfg.n_heads
        self.rope = rope
        self.n1, self.n2 = nn.Parameter(torch.ones(d)), nn.Parameter(torch.ones(d))
        self.qkv = nn.Linear(d, (self.h + 2 * self.kv) * self.hd, bias=False)
        self.o = nn.Linear(self.h * self.hd, d, bias=False)
        self.gate_up = nn.Linear(d, 2 * cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, d, bias=False)

    def forward(self, x: torch.Tensor, cache: list | None = None, at: int = 0) -> torch.Tensor:
        b, t, _ = x.shape
        h, kv, hd = self.h, self.kv, self.hd
        q, k, v = self.qkv(rms(x, self.n1)).view(b, t, h + 2 * kv, hd).transpose(1, 2).split([h, kv, kv], 1)
        q, k = self.rope(q, at), self.rope(k, at)
        if cache is not None:
            cache[0][:, :, at : at + t], cache[1][:, :, at : at + t] = k, v
            k, v = cache[0][:, :, : at + t], cache[1][:, :, : at + t]
        causal = cache is None or t > 1
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv != h)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, h * hd))
        g, u = self.gate_up(rms(x, self.n2)).chunk(2, -1)
        return x + self.down(F.silu(g) * u)


class Model(nn.Module):
    """The decoder of the benchmark section's shape, tied head, weights drawn at std 0.02."""

    def __init__(self, cfg: Any):
        super().__init__()
        rope = Rotary(cfg.d_model // cfg.n_heads, max(cfg.seq_len, cfg.prompt_len + cfg.new_tokens))
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, rope) for _ in range(cfg.n_layers))
        self.norm = nn.Parameter(torch.ones(cfg.d_model))
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor, start: int = 0, caches: list | None = None) -> torch.Tensor:
        x = self.embed(tokens)
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i], start)
        return rms(x, self.norm) @ self.embed.weight.T  # tied head


def train_seconds(model: Model, cfg: Any, warmup: int, reps: int) -> list[float]:
    """Seconds per AdamW train step on a random batch of the section's rows."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    tokens = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1))

    def step() -> None:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return timed(step, warmup, reps)


def decode_seconds(model: Model, cfg: Any, batch: int, warmup: int, reps: int) -> list[float]:
    """Seconds per greedy generation of `cfg.new_tokens` for `batch` random prompts, KV cache preallocated."""
    kv, hd, capacity = cfg.n_kv_heads, cfg.d_model // cfg.n_heads, cfg.prompt_len + cfg.new_tokens
    prompt = torch.randint(10, cfg.vocab_size, (batch, cfg.prompt_len))

    @torch.no_grad()
    def generate() -> None:
        caches = [[torch.zeros(batch, kv, capacity, hd) for _ in range(2)] for _ in range(cfg.n_layers)]
        logits = model(prompt, 0, caches)[:, -1]
        at = prompt.shape[1]
        for _ in range(cfg.new_tokens):
            token = logits.argmax(-1, keepdim=True)
            logits = model(token, at, caches)[:, -1]
            at += 1

    return timed(generate, warmup, reps)


def run_peer(cfg: Any, warmup: int, reps: int) -> dict[str, list[float]]:
    """Seconds per train step and per cached generation at batch 1 and 8 (`cfg`: the benchmark section)."""
    torch.manual_seed(0)
    model = Model(cfg)
    samples = {"train_step_seconds": train_seconds(model, cfg, warmup, reps)}
    model.eval()
    for batch in (1, 8):
        samples[f"cached_b{batch}_seconds"] = decode_seconds(model, cfg, batch, warmup, reps)
    samples["threads"] = [float(torch.get_num_threads())]
    assert math.isfinite(samples["train_step_seconds"][0])
    return samples
