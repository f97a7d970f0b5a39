"""The kvtopo ops' side effect (each call appends to the session's store) survives the compiler.

Compiled with Inductor, the rewritten graphs must call `Session.attend` exactly as the graph runs
eagerly: every call (even when nothing uses its output), one call per site (no CSE merging), in
program order. The models are plain SDPA blocks; every step feeds the same shape (chunked
prefill), so each model compiles once.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kvtopo
import kvtopo.passes.manager as manager
from kvtopo.kernels.ops import DECOMPOSITIONS
from kvtopo.models.blocks import SDPACausal
from kvtopo.runtime.session import Session

HIDDEN, CHUNK, STEPS = 32, 3, 2


def _short(layer: str) -> str:
    """The module path of a store's layer name, without the compiled model's prefix."""
    return layer.rsplit("/", 1)[-1]


@pytest.fixture(autouse=True)
def _compile_for_real():
    """Bypass torch's on-disk compile caches: their keys cover the graph, not the op's registered
    effect, so an entry compiled before the effect was registered would be replayed."""
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield


@pytest.fixture
def attends(monkeypatch):
    """Every `Session.attend` call: (layer, tokens that layer held when it was called)."""
    calls = []
    attend = Session.attend

    def recording(self, layer, *args, **kwargs):
        # the session stores the op's layer under '<model>/<layer>'
        cache = next((c for name, c in self.layers.items() if _short(name) == layer), None)
        calls.append((_short(layer), cache.length(0) if cache is not None else 0))
        return attend(self, layer, *args, **kwargs)

    monkeypatch.setattr(Session, "attend", recording)
    return calls


def _run(model: nn.Module, inductor: bool, calls: list):
    """Compile, run STEPS chunks in one session; (attend calls, {layer: tokens stored})."""
    torch._dynamo.reset()
    calls.clear()
    compiled = torch.compile(model, backend="kvtopo", options={"inductor": inductor})
    chunks = torch.randn(STEPS, 1, CHUNK, HIDDEN, generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()) as s:
        for chunk in chunks:
            compiled(chunk)
        stored = {_short(name): cache.length(0) for name, cache in s.layers.items()}
    return list(calls), stored


class Unused(nn.Module):
    """Layer `a`'s attention reaches nothing the model returns, in three ways."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.a, self.b = how, SDPACausal(seed=0), SDPACausal(seed=1)

    def forward(self, x):
        out = self.a(x)
        if self.how == "times_zero":
            x = x + 0 * out  # Inductor folds the product to zeros
        elif self.how == "zeros_like":
            x = x + torch.zeros_like(out)  # only out's shape is used
        # "discarded": out is simply dropped
        return self.b(x)


@pytest.mark.parametrize("how", ["discarded", "times_zero", "zeros_like"])
def test_a_layer_whose_output_is_unused_still_stores_and_attends(how, attends):
    calls, stored = _run(Unused(how).eval(), True, attends)
    # Both layers are called at every step, and the second step of `a` attends over the first.
    assert calls == [("a", 0), ("b", 0), ("a", CHUNK), ("b", CHUNK)]
    assert stored == {"a": STEPS * CHUNK, "b": STEPS * CHUNK}


class TwoSitesOneModule(SDPACausal):
    """Two attention sites in one module over the very same q/k/v nodes."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        first = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        second = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.out(first) + 2 * self.out(second)


class SharedInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = TwoSitesOneModule(seed=0)

    def forward(self, x):
        return self.attn(x)


def test_identical_sites_are_not_merged(attends):
    calls, stored = _run(SharedInputs().eval(), True, attends)
    names = sorted(stored)
    assert names == ["attn", "attn#1"], stored  # the pass gives the second call its own name
    assert [layer for layer, _ in calls] == names * STEPS
    assert set(stored.values()) == {STEPS * CHUNK}


def test_identical_sites_with_the_same_layer_name_both_run(attends, monkeypatch):
    """Even identical calls (same inputs, same layer string) are two calls: nothing may CSE them."""
    monkeypatch.setattr(manager, "_unique_layers", lambda sites, *args, **kwargs: list(sites))
    calls, stored = _run(SharedInputs().eval(), True, attends)
    assert len(calls) == 2 * STEPS and len({layer for layer, _ in calls}) == 1
    assert list(stored.values()) == [2 * STEPS * CHUNK]  # both calls appended their chunk


class Independent(nn.Module):
    """`b` runs first in the program; neither layer's input depends on the other's output."""

    def __init__(self):
        super().__init__()
        self.a, self.b = SDPACausal(seed=0), SDPACausal(seed=1)

    def forward(self, x):
        later = self.b(x * 2)
        earlier = self.a(x)
        return earlier + later


def test_independent_layers_reach_the_session_in_program_order(attends):
    eager_calls, _ = _run(Independent().eval(), False, attends)
    assert eager_calls == [("b", 0), ("a", 0), ("b", CHUNK), ("a", CHUNK)]
    inductor_calls, _ = _run(Independent().eval(), True, attends)
    assert inductor_calls == eager_calls


def test_export_still_decomposes_the_op():
    """`run_decompositions(DECOMPOSITIONS)` must leave no kvtopo op, not even inside an effect
    wrapper (`with_effects(token, kvtopo.attention, ...)`), and compute the block's attention."""
    from kvtopo.backend import kvtopo_backend

    block = SDPACausal(seed=0).eval()
    graphs = []

    def capture(gm, example_inputs):
        compiled = kvtopo_backend(gm, example_inputs, options={"inductor": False})
        graphs.append((gm, list(example_inputs)))
        return compiled

    x = torch.randn(1, 5, HIDDEN)
    with torch.no_grad():
        torch.compile(block, backend=capture)(x)
    (gm, inputs), = graphs
    program = torch.export.export(gm, tuple(inputs), strict=False)
    decomposed = program.run_decompositions(DECOMPOSITIONS)

    def kvtopo_ops(graph):
        return [n for n in graph.nodes for t in (n.target, *n.args)
                if isinstance(t, torch._ops.OpOverload) and t.namespace == "kvtopo"]

    assert kvtopo_ops(program.graph)  # the op was exported ...
    assert not kvtopo_ops(decomposed.graph), decomposed.graph  # ... and decomposed away
    with torch.no_grad():
        got = decomposed.module()(*inputs)
        got = got[0] if isinstance(got, (tuple, list)) else got
        torch.testing.assert_close(got, block(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("compile_kwargs,reason", [
    ({"mode": "reduce-overhead"}, "mode='reduce-overhead' turns on CUDA graphs"),
    ({"mode": "max-autotune"}, "mode='max-autotune' turns on CUDA graphs"),
    ({"options": {"triton.cudagraphs": True}}, r"option\(s\) \['triton.cudagraphs'\] refused"),
])
def test_cuda_graphs_are_refused_with_the_reason(compile_kwargs, reason):
    """A replayed CUDA graph would skip the op's host-side session work, so kvtopo refuses it."""
    compiled = torch.compile(SDPACausal(seed=0).eval(), backend="kvtopo", **compile_kwargs)
    with torch.no_grad(), pytest.raises(Exception, match=reason) as refused:
        compiled(torch.randn(1, CHUNK, HIDDEN))
    assert "appends to its KV store on the host" in str(refused.value)


def test_inductors_global_cuda_graph_flag_is_refused_too():
    block, x = SDPACausal(seed=0).eval(), torch.randn(1, CHUNK, HIDDEN)
    with torch._inductor.config.patch({"triton.cudagraphs": True}), torch.no_grad():
        with pytest.raises(Exception, match="triton.cudagraphs is True"):
            torch.compile(block, backend="kvtopo")(x)
        torch._dynamo.reset()
        # Without Inductor the flag is moot: the graph runs as Python.
        got = torch.compile(block, backend="kvtopo", options={"inductor": False})(x)
        torch.testing.assert_close(got, block(x), atol=1e-5, rtol=0)


def test_other_modes_are_refused_as_unsupported():
    compiled = torch.compile(SDPACausal(seed=0).eval(), backend="kvtopo", mode="max-autotune-no-cudagraphs")
    with torch.no_grad(), pytest.raises(Exception, match="takes no mode"):
        compiled(torch.randn(1, CHUNK, HIDDEN))
