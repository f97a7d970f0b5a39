"""Every zoo model: one kvtopo op per attention layer, no added graph break, outputs unchanged."""

import pytest
import torch
import torch.nn.functional as F

import kvtopo
from kvtopo.backend import REPORTS
from kvtopo.models import zoo

CASES = [(name, impl) for name in zoo.ZOO_MODELS if name != "llama-8layer" for impl in zoo.ATTN_IMPLEMENTATIONS]


def _graphs(model, x, backend):
    """The FX graphs Dynamo hands to `backend` (a counting wrapper), and the compiled output."""
    seen = []

    def counting(gm, example_inputs):
        seen.append(gm)
        return backend(gm, example_inputs)

    with torch.no_grad():
        out = torch.compile(model, backend=counting)(x, use_cache=False)
    return seen, out


def _count(gm, targets):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in targets)


@pytest.mark.parametrize("name,impl", CASES)
def test_every_attention_layer_becomes_one_kvtopo_op(name, impl):
    model = zoo.build(name, impl)
    x = torch.randint(0, 256, (2, 24))
    plain_graphs, _ = _graphs(model, x, lambda gm, ex: gm.forward)
    before_sdpa = sum(_count(g, {F.scaled_dot_product_attention}) for g in plain_graphs)
    before_softmax = sum(_count(g, {F.softmax, torch.softmax}) for g in plain_graphs) + \
        sum(1 for g in plain_graphs for n in g.graph.nodes if n.op == "call_method" and n.target == "softmax")
    torch._dynamo.reset()

    layers = zoo.num_attention_layers(model)
    from kvtopo.backend import kvtopo_backend
    graphs, out = _graphs(model, x, lambda gm, ex: kvtopo_backend(gm, ex, options={"inductor": False}))
    kvtopo_ops = {torch.ops.kvtopo.attention.default, torch.ops.kvtopo.mla_attention.default}
    after = sum(_count(g, kvtopo_ops) for g in graphs)
    sdpa_after = sum(_count(g, {F.scaled_dot_product_attention}) for g in graphs)

    assert len(graphs) == len(plain_graphs), "kvtopo added a graph break"
    assert after == layers
    if impl == "sdpa":
        assert before_sdpa == layers and sdpa_after == 0
    else:
        assert before_softmax >= layers and sdpa_after == 0


# Inductor (kvtopo.compile's default) on one model per kvtopo op; the passes, the same on every
# model, are checked without it (each Inductor compile costs tens of seconds on CPU).
INDUCTOR_CASES = {("llama", "sdpa"), ("deepseek-v3", "sdpa")}


@pytest.mark.parametrize("name,impl", CASES)
def test_compiled_output_equals_eager_outside_a_session(name, impl):
    model = zoo.build(name, impl)
    x = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        expected = model(x, use_cache=False).logits
        REPORTS.clear()
        compiled = torch.compile(model, backend="kvtopo", options={"inductor": (name, impl) in INDUCTOR_CASES})
        got = compiled(x, use_cache=False).logits
    assert sum(len(r.sites) for r in REPORTS) == zoo.num_attention_layers(model)
    assert not any(r.refusals for r in REPORTS)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_inspect_reports_shape_facts():
    model = zoo.build("llama")
    report = kvtopo.inspect(model, torch.randint(0, 256, (1, 8)), use_cache=False)
    assert [s.layer for s in report.sites] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    site = report.sites[0]
    assert (site.heads, site.kv_heads, site.head_dim, site.value_head_dim) == (4, 2, 16, 16)
    assert site.scale == pytest.approx(0.25)
    assert "heads=4 kv_heads=2" in report.format()


def test_eight_layer_model_with_inductor():
    model = zoo.build("llama-8layer")
    x = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        expected = model(x, use_cache=False).logits
        REPORTS.clear()
        got = kvtopo.compile(model)(x, use_cache=False).logits
    assert sum(len(r.sites) for r in REPORTS) == zoo.num_attention_layers(model) == 8  # rewritten, not left as is
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
