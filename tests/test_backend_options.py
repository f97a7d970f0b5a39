"""The options `torch.compile(model, backend="kvtopo", options=...)` accepts, and what they decide.

`options={"inductor": bool}` is all the backend takes: any other key, or an `inductor` that is not
a bool, must be refused with the reason rather than silently ignored (a typo such as
`{"inductr": False}` would otherwise compile with Inductor behind the user's back). And the flag
must actually decide whether the rewritten graph is handed to Inductor: `inductor=False` is the
debugging path that runs the rewritten graph as Python, the default hands it to Inductor once per
graph. Outputs are compared with the uncompiled block's.
"""

import pytest
import torch

import torch._inductor.compile_fx as compile_fx_module

from kvtopo.models.blocks import SDPACausal

HIDDEN, CHUNK = 32, 3


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def inductor_calls(monkeypatch):
    """Every graph handed to Inductor's `compile_fx`; the stand-in runs the graph as Python, so
    these tests stay fast and still see where the backend sent each graph."""
    calls = []

    def fake_compile_fx(gm, example_inputs, *args, **kwargs):
        calls.append(gm)
        return gm.forward

    monkeypatch.setattr(compile_fx_module, "compile_fx", fake_compile_fx)
    return calls


@pytest.mark.parametrize("options,reason", [
    ({"inductr": False}, r"unknown kvtopo backend option\(s\) \['inductr'\]"),
    ({"inductor": False, "fullgraph": True}, r"unknown kvtopo backend option\(s\) \['fullgraph'\]"),
    ({"inductor": "no"}, r"backend option inductor='no' must be a bool"),
    ({"inductor": 0}, r"backend option inductor=0 must be a bool"),
])
def test_backend_options_other_than_a_bool_inductor_are_refused(options, reason, inductor_calls):
    block = SDPACausal(seed=0).eval()
    with torch.no_grad(), pytest.raises(Exception, match=reason):
        torch.compile(block, backend="kvtopo", options=options)(torch.randn(1, CHUNK, HIDDEN))
    assert inductor_calls == []  # refused before anything was compiled


def test_inductor_false_runs_the_rewritten_graph_without_inductor(inductor_calls):
    block, x = SDPACausal(seed=0).eval(), torch.randn(1, CHUNK, HIDDEN)
    with torch.no_grad():
        got = torch.compile(block, backend="kvtopo", options={"inductor": False})(x)
        torch.testing.assert_close(got, block(x), atol=1e-5, rtol=0)
    assert inductor_calls == []


@pytest.mark.parametrize("options", [None, {"inductor": True}])
def test_by_default_the_rewritten_graph_goes_to_inductor_once(options, inductor_calls):
    block, x = SDPACausal(seed=0).eval(), torch.randn(1, CHUNK, HIDDEN)
    with torch.no_grad():
        got = torch.compile(block, backend="kvtopo", options=options)(x)
        torch.testing.assert_close(got, block(x), atol=1e-5, rtol=0)
    assert len(inductor_calls) == 1
    # Inductor receives the rewritten graph: kvtopo's op in place of the SDPA call.
    targets = {n.target for n in inductor_calls[0].graph.nodes if n.op == "call_function"}
    assert torch.ops.kvtopo.attention.default in targets
    assert torch.nn.functional.scaled_dot_product_attention not in targets
