"""The DeepSeek-V3-shaped MLA rows of bench/memory.py: KV bytes per token for per-head K/V
caching, latent caching and latent + topo compression, with the attention-output error vs exact
attention.

Shapes are DeepSeek-V3's attention (128 heads, kv_lora_rank 512, RoPE key 64, nope 128, v 128);
the latent and RoPE keys are synthesized with a decaying spectrum (RoPE applied at the true
positions), the up-projection is random. Everything goes through the real `kvtopo::mla_attention`
op inside a session; the reference is the per-head attention of the original formulation in
float64 (which expands K/V for all 128 heads: that is what limits these rows to a few thousand
tokens on this machine).
"""

from __future__ import annotations

import time

import torch

import kvtopo

HEADS, LATENT, ROPE, NOPE, VDIM = 128, 512, 64, 128, 128


def _rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float64) / half))
    angle = positions[:, None].double() * freqs
    cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.double() * cos + rotated * sin).to(x.dtype)


def synthesize(tokens: int, queries: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    spectrum = torch.logspace(0, -1.5, LATENT)
    latent = torch.randn(1, 1, tokens + queries, LATENT, generator=g) * spectrum
    latent = latent / latent.norm(dim=-1, keepdim=True) * LATENT ** 0.5  # kv_a_layernorm output scale
    positions = torch.arange(tokens + queries)
    rope_key = _rope(torch.randn(1, 1, tokens + queries, ROPE, generator=g), positions)
    weight = torch.randn(HEADS * (NOPE + VDIM), LATENT, generator=g) / LATENT ** 0.5
    # Queries at every position: the prefill's feed the observation window eviction scores use.
    query = torch.randn(1, HEADS, tokens + queries, NOPE + ROPE, generator=g)
    query[..., NOPE:] = _rope(query[..., NOPE:], positions)
    return latent, rope_key, weight, query[:, :, :tokens].half(), query[:, :, tokens:]


def exact_reference(latent, rope_key, weight, query, scale) -> torch.Tensor:
    """The original per-head formulation in float64: expand K/V for every head, then attend."""
    w = weight.double().view(HEADS, NOPE + VDIM, LATENT)
    kv = torch.einsum("btr,hdr->bhtd", latent[:, 0].double(), w)
    keys = torch.cat([kv[..., :NOPE], rope_key.double().expand(-1, HEADS, -1, -1)], dim=-1)
    values = kv[..., NOPE:]
    q = query.double()
    t, n = q.shape[2], keys.shape[2]
    mask = torch.arange(n)[None, :] <= torch.arange(t)[:, None] + (n - t)
    scores = (q @ keys.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ values


def run(tokens: int, queries: int, log=print) -> list[dict]:
    latent, rope_key, weight, prefill_q, query = synthesize(tokens, queries)
    scale = (NOPE + ROPE) ** -0.5
    start = time.perf_counter()
    expected = exact_reference(latent, rope_key, weight, query, scale)
    rows = [{"cache": "per-head K/V (fp16)", "bytes_per_token": HEADS * (NOPE + ROPE + VDIM) * 2, "error": 0.0}]
    configs = {
        "latent, lossless (fp16)": kvtopo.Config.lossless(page_size=32),
        "latent + topo default": kvtopo.Config(),
        "latent + topo, projected at 0.9 energy": kvtopo.Config(key_energy=0.9, value_energy=0.9),
        "latent + topo 8-bit, 0.99 energy": kvtopo.Config(mid_bits=8, key_energy=0.99, target_ratio=None),
    }
    for name, config in configs.items():
        with kvtopo.session(config) as s:
            for lo in range(0, tokens, 2048):
                hi = min(lo + 2048, tokens)
                torch.ops.kvtopo.mla_attention(prefill_q[:, :, lo:hi], latent[:, :, lo:hi].half(), rope_key[:, :, lo:hi].half(),
                                               weight.half(), None, scale, False, "mla", NOPE)
            out = torch.ops.kvtopo.mla_attention(query.half(), latent[:, :, tokens:].half(), rope_key[:, :, tokens:].half(),
                                                 weight.half(), None, scale, False, "mla", NOPE)
            stats = s.stats()
        error = ((out.double() - expected).norm() / expected.norm()).item()
        rows.append({"cache": name, "bytes_per_token": stats.total_bytes / stats.tokens[0],
                     "ratio_vs_latent_fp16": stats.ratio_vs_fp16, "error": error})
    for row in rows:
        row["vs_per_head_kv"] = rows[0]["bytes_per_token"] / row["bytes_per_token"]
    log(f"MLA layer, {tokens} tokens ({time.perf_counter() - start:.0f}s)")
    log(f"  {'cache':46} {'B/token':>9} {'x smaller than per-head':>24} {'error':>8}")
    for row in rows:
        log(f"  {row['cache']:46} {row['bytes_per_token']:9.1f} {row['vs_per_head_kv']:24.1f} {row['error']:8.4f}")
    return rows
