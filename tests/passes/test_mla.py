"""DeepSeek-V3 MLA: found and rewritten to cache the latent; refused when not provably MLA."""

import pytest
import torch
import torch.nn.functional as F

import kvtopo
from kvtopo.models import zoo
from kvtopo.passes.find_mla import find_mla_sites
from kvtopo.passes.manager import run_passes


def _graph(model, ids):
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        torch.compile(model, backend=capture)(ids, use_cache=False)
    assert len(graphs) == 1
    return graphs[0]


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v3-wide"])
def test_lossless_bytes_per_token_are_latent_plus_rope_key(name):
    model = zoo.build(name)
    cfg = model.config
    compiled = kvtopo.compile(model, inductor=False)
    ids = torch.randint(0, 256, (1, 64))
    with kvtopo.session(kvtopo.Config.lossless(page_size=16)) as s:
        kvtopo.generate(compiled, ids, 1)
        stats = s.stats()
    per_token = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4  # float32 elements
    live = {layer: s.layers[layer].pool.live_pages * s.layers[layer].pool.page_nbytes for layer in s.layers}
    assert set(live.values()) == {64 * per_token}  # 4 full pages of 16 tokens, nothing else per token
    per_head_kv = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * 4
    assert per_head_kv > 3 * per_token
    assert stats.fp16_bytes == 2 * 64 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2


def test_a_second_mla_model_with_another_scale_is_rewritten_and_exact():
    """Dynamo makes the scale of a second model of the same class (another head dim) a graph
    input: its report names that input (formatting it as a number crashed the compile)."""
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    for overrides in ({}, {"qk_nope_head_dim": 24}):
        model = zoo.build("deepseek-v3", **overrides)
        with torch.no_grad():
            expected = model(ids).logits
        compiled = kvtopo.compile(model, inductor=False)
        with kvtopo.session(kvtopo.Config.lossless()) as s, torch.no_grad():
            got = compiled(ids).logits
        assert len(s.layers) == model.config.num_hidden_layers  # attended through the store
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_mla_with_topo_compression_stays_close_to_exact():
    model = zoo.build("deepseek-v3")
    compiled = kvtopo.compile(model, inductor=False)
    ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(0))
    _, exact = kvtopo.generate(compiled, ids, 8, config=kvtopo.Config.lossless(), return_logits=True)
    config = kvtopo.Config(page_size=16, sink_tokens=16, recent_tokens=32, key_energy=0.99, mid_bits=8,
                           target_ratio=None)
    with kvtopo.session(config) as s:
        _, compressed = kvtopo.generate(compiled, ids, 8, return_logits=True)
        stats = s.stats()
        mid_tokens = sum(c.sequences[0].mid.tokens for c in s.layers.values())
    exact_per_token = (model.config.kv_lora_rank + model.config.qk_rope_head_dim) * 4
    assert mid_tokens > 0 and stats.per_kind["mid"] / mid_tokens < exact_per_token / 2
    relative = (compressed - exact).norm() / exact.norm()
    assert relative < 0.05, relative


class _ModifiedSplitMLA(torch.nn.Module):
    """MLA-shaped, but the up-projection is split [nope, v] from a *different* tensor than the
    key is allocated from (values from a scaled copy): not provably MLA."""

    def __init__(self, heads=2, latent=8, nope=4, rope=4, v=4):
        super().__init__()
        torch.manual_seed(0)
        self.h, self.nope, self.rope, self.v = heads, nope, rope, v
        self.q = torch.nn.Linear(16, heads * (nope + rope), bias=False)
        self.kv_a = torch.nn.Linear(16, latent + rope, bias=False)
        self.kv_b = torch.nn.Linear(latent, heads * (nope + v), bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.h, -1).transpose(1, 2)
        latent, k_rope = torch.split(self.kv_a(x), [self.kv_b.in_features, self.rope], dim=-1)
        latent, k_rope = latent.view(b, 1, t, -1), k_rope.view(b, 1, t, -1)
        kv = self.kv_b(latent).view(b, t, -1, self.nope + self.v).transpose(1, 2)
        k_nope, _ = torch.split(kv, [self.nope, self.v], dim=-1)
        _, value = torch.split(kv * 1.5, [self.nope, self.v], dim=-1)
        key = kv.new_empty(b, self.h, t, self.nope + self.rope)
        key[..., : self.nope].copy_(k_nope)
        key[..., self.nope:].copy_(k_rope.expand(-1, self.h, -1, -1))
        return F.scaled_dot_product_attention(q, key, value, is_causal=True)


def test_mla_pass_refuses_a_modified_split_and_leaves_the_graph_unchanged():
    block = _ModifiedSplitMLA().eval()
    x = torch.randn(1, 5, 16)
    graphs = []

    def check(gm, example_inputs):
        before = [(n.op, n.target, n.args) for n in gm.graph.nodes]
        sites, refusals = find_mla_sites(gm)
        graphs.append((sites, refusals, before == [(n.op, n.target, n.args) for n in gm.graph.nodes]))
        return gm.forward

    with torch.no_grad():
        torch.compile(block, backend=check)(x)
    (sites, refusals, unchanged), = graphs
    assert not sites and unchanged
    assert len(refusals) == 1 and "not split from the same tensor" in refusals[0].reason


def test_mla_rewrite_counts_and_removes_per_head_key_construction():
    model = zoo.build("deepseek-v3")
    gm = _graph(model, torch.randint(0, 256, (1, 6)))
    count = lambda target, kind="call_function": sum(1 for n in gm.graph.nodes if n.op == kind and n.target == target)
    assert count(F.scaled_dot_product_attention) == 2 and count("copy_", "call_method") == 4
    report = run_passes(gm)
    assert [type(s).__name__ for s in report.sites] == ["MLASite", "MLASite"]
    assert count(torch.ops.kvtopo.mla_attention.default) == 2
    assert count(F.scaled_dot_product_attention) == 0 and count("copy_", "call_method") == 0
    assert count("new_empty", "call_method") == 0


class _RopeHeadsMLA(torch.nn.Module):
    """MLA as DeepSeek writes it, its RoPE key with `rope_heads` heads expanded over the query
    heads: one is the shared key the op caches beside the latent; one per head is not MLA."""

    def __init__(self, rope_heads, heads=2, latent=8, nope=4, rope=4, v=4):
        super().__init__()
        torch.manual_seed(0)
        self.h, self.rope_heads, self.nope, self.rope, self.v = heads, rope_heads, nope, rope, v
        self.q = torch.nn.Linear(16, heads * (nope + rope), bias=False)
        self.kv_a = torch.nn.Linear(16, latent + rope_heads * rope, bias=False)
        self.kv_b = torch.nn.Linear(latent, heads * (nope + v), bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.h, -1).transpose(1, 2)
        latent, k_rope = torch.split(self.kv_a(x), [self.kv_b.in_features, self.rope_heads * self.rope], dim=-1)
        latent, k_rope = latent.view(b, 1, t, -1), k_rope.view(b, t, self.rope_heads, self.rope).transpose(1, 2)
        kv = self.kv_b(latent).view(b, t, -1, self.nope + self.v).transpose(1, 2)
        k_nope, value = torch.split(kv, [self.nope, self.v], dim=-1)
        key = kv.new_empty(b, self.h, t, self.nope + self.rope)
        key[..., : self.nope].copy_(k_nope)
        key[..., self.nope:].copy_(k_rope.expand(-1, self.h, -1, -1))
        return F.scaled_dot_product_attention(q, key, value, is_causal=True)


def test_a_rope_key_per_head_is_not_taken_for_mlas_shared_one():
    """Cached as one shared key, every head would attend with head 0's RoPE part. The pass proves
    the one-head form and refuses the per-head one, which the plain finder caches per head, exactly."""
    x = torch.randn(1, 5, 16)
    found = []

    def check(gm, example_inputs):
        found.append(find_mla_sites(gm))
        return gm.forward

    for rope_heads in (1, 2):
        with torch.no_grad():
            torch.compile(_RopeHeadsMLA(rope_heads).eval(), backend=check)(x)
    (shared, none), (per_head, refusals) = found
    assert len(shared) == 1 and not none and not per_head
    assert len(refusals) == 1 and "not shared across heads" in refusals[0].reason
    block = _RopeHeadsMLA(2).eval()
    with torch.no_grad():
        expected = block(x)
        got = torch.compile(block, backend="kvtopo", options={"inductor": False})(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
