"""The peer a user would otherwise pick: the same decoder in plain PyTorch, timed like ours.

Used by the benchmark stage only when torch is importable (it is never a dependency of
stagelm): a float32 train step (AdamW, the same loss) and greedy decoding with a
preallocated KV cache, on the benchmark section's shape, random weights and tokens.
"""

import math
import time
from typing import Any


def run_peer(cfg: Any, warmup: int, reps: int) -> dict[str, list[float]]:
    """Seconds per train step and per cached generation at batch 1 and 8 (`cfg`: the benchmark section)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_model // cfg.n_heads

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    longest = max(cfg.seq_len, cfg.prompt_len + cfg.new_tokens)
    freqs = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    angles = torch.arange(longest, dtype=torch.float32)[:, None] * freqs[None]
    cos_table, sin_table = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def rope(x: torch.Tensor, start: int) -> torch.Tensor:  # x: (B, heads, T, hd), rotate-half
        t = x.shape[2]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos_table[start : start + t] + torch.cat([-x2, x1], -1) * sin_table[start : start + t]

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n1, self.n2 = nn.Parameter(torch.ones(d)), nn.Parameter(torch.ones(d))
            self.qkv = nn.Linear(d, (h + 2 * kv) * hd, bias=False)
            self.o = nn.Linear(h * hd, d, bias=False)
            self.gate_up = nn.Linear(d, 2 * cfg.d_ff, bias=False)
            self.down = nn.Linear(cfg.d_ff, d, bias=False)

        def forward(self, x: torch.Tensor, cache: list | None = None, at: int = 0) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = self.qkv(rms(x, self.n1)).view(b, t, h + 2 * kv, hd).transpose(1, 2).split([h, kv, kv], 1)
            q, k = rope(q, at), rope(k, at)
            if cache is not None:
                cache[0][:, :, at : at + t], cache[1][:, :, at : at + t] = k, v
                k, v = cache[0][:, :, : at + t], cache[1][:, :, : at + t]
            causal = cache is None or t > 1
            y = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv != h)
            x = x + self.o(y.transpose(1, 2).reshape(b, t, h * hd))
            g, u = self.gate_up(rms(x, self.n2)).chunk(2, -1)
            return x + self.down(F.silu(g) * u)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(cfg.vocab_size, d)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg.n_layers))
            self.norm = nn.Parameter(torch.ones(d))
            for p in self.parameters():
                if p.dim() > 1:
                    nn.init.normal_(p, std=0.02)

        def forward(self, tokens: torch.Tensor, start: int = 0, caches: list | None = None) -> torch.Tensor:
            x = self.embed(tokens)
            for i, block in enumerate(self.blocks):
                x = block(x, None if caches is None else caches[i], start)
            return rms(x, self.norm) @ self.embed.weight.T  # tied head

    model = Model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    tokens = torch.randint(0, cfg.vocab_size, (cfg.batch_size, cfg.seq_len + 1))

    def train_step() -> None:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def timed(fn: Any) -> list[float]:
        for _ in range(warmup):
            fn()
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out

    samples = {"train_step_seconds": timed(train_step)}
    model.eval()
    capacity = cfg.prompt_len + cfg.new_tokens
    for batch in (1, 8):
        prompt = torch.randint(10, cfg.vocab_size, (batch, cfg.prompt_len))

        @torch.no_grad()
        def generate(prompt: torch.Tensor = prompt, batch: int = batch) -> None:
            caches = [[torch.zeros(batch, kv, capacity, hd) for _ in range(2)] for _ in range(cfg.n_layers)]
            logits = model(prompt, 0, caches)[:, -1]
            at = prompt.shape[1]
            for _ in range(cfg.new_tokens):
                token = logits.argmax(-1, keepdim=True)
                logits = model(token, at, caches)[:, -1]
                at += 1

        samples[f"cached_b{batch}_seconds"] = timed(generate)
    samples["threads"] = [float(torch.get_num_threads())]
    assert math.isfinite(samples["train_step_seconds"][0])
    return samples
