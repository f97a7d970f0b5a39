"""A model compiled with kvtopo and called with autograd on (outside `torch.no_grad`, parameters
requiring grad) gets an error that says why and what to do, not AOTAutograd's failure from inside
Inductor; the same model then runs under `torch.no_grad()` and `torch.inference_mode()`. A model
whose attention is frozen (only a layer after it trains) compiles and trains as it did.
With `inductor=False` the forward runs with autograd on, and a backward through the attention
raises rather than returning gradients of something else."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kvtopo


class Attention(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.head_dim = heads, dim // heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1))


def _inputs():
    return torch.randn(1, 6, 32, generator=torch.Generator().manual_seed(0))


def test_autograd_on_is_refused_with_the_way_out_then_no_grad_and_inference_mode_run():
    torch._dynamo.reset()
    reference, model = Attention().eval(), kvtopo.compile(Attention().eval())
    x = _inputs()
    with pytest.raises(Exception, match=r"for inference.*torch\.no_grad\(\) or torch\.inference_mode\(\)"):
        model(x)
    with torch.no_grad():
        expected = reference(x)
        torch.testing.assert_close(model(x), expected)
        with kvtopo.session(kvtopo.Config.lossless()):
            torch.testing.assert_close(model(x), expected)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), expected)
    torch._dynamo.reset()


def test_without_inductor_the_forward_runs_with_autograd_on_and_a_backward_raises():
    torch._dynamo.reset()
    reference, model = Attention().eval(), kvtopo.compile(Attention().eval(), inductor=False)
    x = _inputs()
    out = model(x)
    torch.testing.assert_close(out, reference(x))
    with pytest.raises(RuntimeError, match="kvtopo.attention"):
        out.sum().backward()
    torch._dynamo.reset()


def test_frozen_attention_under_a_trained_layer_compiles_and_gives_its_gradients():
    torch._dynamo.reset()
    reference, model = Attention().eval(), Attention().eval()
    for m in (reference, model):
        m.qkv.requires_grad_(False)
    kvtopo.compile(model)
    x = _inputs()
    out, expected = model(x), reference(x)
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(model.out.weight.grad, reference.out.weight.grad)
    torch._dynamo.reset()


def test_without_inductor_a_session_under_autograd_stores_no_graph_and_computes_what_no_grad_does():
    """The store copies each chunk's keys and values into its pool: with autograd on it keeps no
    autograd graph alive (no memory held for a backward that cannot run), and every chunk's
    output is bit for bit the one under `torch.no_grad()`."""
    torch._dynamo.reset()
    model = kvtopo.compile(Attention().eval(), inductor=False)
    x = torch.randn(1, 40, 32, generator=torch.Generator().manual_seed(1))
    config = kvtopo.Config(page_size=8, prefill_chunk_size=16)
    chunks = [x[:, :16], x[:, 16:32], x[:, 32:33], x[:, 33:34]]
    with kvtopo.session(config) as session:
        outs = [model(chunk) for chunk in chunks]
        pools = [layer.pool for layer in session.layers.values() if layer.pool is not None]
        assert pools and not any(p.keys.requires_grad or p.values.requires_grad for p in pools)
    with torch.no_grad(), kvtopo.session(config):
        expected = [model(chunk) for chunk in chunks]
    assert outs[-1].requires_grad
    for got, want in zip(outs, expected, strict=True):
        assert torch.equal(got.detach(), want)
    torch._dynamo.reset()
