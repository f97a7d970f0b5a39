"""Two attention sites of one module found by different passes keep separate caches.

A module that calls SDPA and then attends again with hand-written (eager) attention has two sites
with the same module path; the SDPA pass finds the first, the eager pass the second. Each site
must get its own layer name ('#k' suffix), counted across passes, or both calls would append to
one cache and the second would attend over the first's keys. Checked against the uncompiled
module: inside a lossless session, chunk by chunk, the compiled module must equal one full forward.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import kvtopo
from kvtopo.models.blocks import SDPACausal

HIDDEN, CHUNK, STEPS = 32, 3, 2


class SdpaThenEager(SDPACausal):
    def forward(self, x):
        q, k, v = self.qkv(x)
        first = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        t = x.shape[1]
        causal = torch.full((t, t), float("-inf")).triu(1)
        scores = q @ self.repeat_kv(k).transpose(-1, -2) * (q.shape[-1] ** -0.5)
        second = torch.softmax(scores + causal, dim=-1) @ self.repeat_kv(v)
        return self.out(first) + 2 * self.out(second)


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = SdpaThenEager(seed=0)

    def forward(self, x):
        return self.attn(x)


def test_sites_of_one_module_found_by_two_passes_get_distinct_layers():
    model = Wrapper().eval()
    x = torch.randn(1, CHUNK, HIDDEN, generator=torch.Generator().manual_seed(0))
    report = kvtopo.inspect(model, x)
    assert not report.refusals, report.format()
    layers = [s.layer for s in report.sites]
    assert len(layers) == 2 and len(set(layers)) == 2, layers


def test_sites_of_one_module_found_by_two_passes_attend_over_their_own_history():
    torch._dynamo.reset()
    model = Wrapper().eval()
    x = torch.randn(1, STEPS * CHUNK, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x)
        compiled = torch.compile(model, backend="kvtopo", options={"inductor": False})
        with kvtopo.session(kvtopo.Config.lossless()) as s:
            got = torch.cat([compiled(chunk) for chunk in x.split(CHUNK, dim=1)], dim=1)
            stored = sorted(cache.length(0) for cache in s.layers.values())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert stored == [STEPS * CHUNK, STEPS * CHUNK]
    torch._dynamo.reset()
