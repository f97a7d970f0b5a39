"""Config validation, session misuse, the op outside sessions, and the backend entry point."""

import subprocess
import sys
import textwrap

import pytest
import torch

import kvtopo
from kvtopo.kernels.ops import DECOMPOSITIONS
from kvtopo.kernels.reference import grouped_attention


@pytest.mark.parametrize("field,value", [("page_size", 0), ("page_size", 1.5), ("max_pages", 0),
                                         ("prefill_chunk_size", -1), ("policy", "magic"),
                                         ("eviction_scope", "global")])
def test_bad_config_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"Config\.{field}={value!r}"):
        kvtopo.Config(**{field: value})


def test_config_is_immutable():
    config = kvtopo.Config.lossless()
    with pytest.raises(AttributeError):
        config.page_size = 8
    assert config.replace(page_size=8).page_size == 8


def test_session_api_outside_a_session():
    with pytest.raises(RuntimeError, match="kvtopo.session"):
        kvtopo.current_session()
    s = kvtopo.session(kvtopo.Config.lossless())
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(RuntimeError, match="closed"):
        s.attend("layer", q, q, q, None, 0.5)
    with pytest.raises(TypeError, match="kvtopo.Config"):
        kvtopo.session({"page_size": 4})


def test_sessions_exited_out_of_order_raise_instead_of_leaving_a_closed_one_active():
    """A context variable restores, on exit, what was active at entry: exiting the outer session
    first used to leave it active (closed) after the inner one exited."""
    outer, inner = kvtopo.session(kvtopo.Config.lossless()), kvtopo.session(kvtopo.Config.lossless())
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(RuntimeError, match="not the innermost active session"):
        outer.__exit__(None, None, None)
    inner.__exit__(None, None, None)
    outer.__exit__(None, None, None)
    assert kvtopo.runtime.context.active_session() is None


def test_session_batch_size_is_fixed():
    q = torch.randn(2, 2, 3, 4)
    with kvtopo.session(kvtopo.Config.lossless()) as s:
        s.attend("l", q, q, q, None, 0.5)
        with pytest.raises(ValueError, match="batch 1"):
            s.attend("l", q[:1], q[:1], q[:1], None, 0.5)


def test_positional_bias_is_refused_inside_a_session():
    q = torch.randn(1, 2, 3, 4)
    with kvtopo.session(kvtopo.Config.lossless()) as s:
        with pytest.raises(ValueError, match="positional bias"):
            s.attend("l", q, q, q, torch.randn(3, 3), 0.5)


def test_op_outside_a_session_is_exact_attention_with_gqa():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 8, 5, 16, generator=g), torch.randn(2, 2, 7, 16, generator=g), torch.randn(2, 2, 7, 16, generator=g)
    mask = torch.rand(5, 7, generator=g) > 0.3
    mask[:, 0] = True
    got = torch.ops.kvtopo.attention(q, k, v, mask, 0.3, False, "l")
    q64, k64, v64 = q.double(), k.double().repeat_interleave(4, 1), v.double().repeat_interleave(4, 1)
    scores = (q64 @ k64.transpose(-1, -2) * 0.3).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(got.double(), scores.softmax(-1) @ v64, atol=1e-5, rtol=0)


class _OpModule(torch.nn.Module):
    def forward(self, q, k, v, mask):
        return torch.ops.kvtopo.attention(q, k, v, mask, 0.25, False, "l")


def test_op_exports_and_decomposes_to_aten():
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    mask = torch.zeros(6, 6).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    program = torch.export.export(_OpModule(), (q, k, v, mask))
    assert any(n.target is torch.ops.kvtopo.attention.default for n in program.graph.nodes)
    decomposed = program.run_decompositions(DECOMPOSITIONS)
    assert not any("kvtopo" in str(n.target) for n in decomposed.graph.nodes)
    torch.testing.assert_close(decomposed.module()(q, k, v, mask), grouped_attention(q, k, v, mask, 0.25), atol=1e-6, rtol=0)


def test_backend_name_works_in_a_fresh_process_without_importing_kvtopo():
    code = textwrap.dedent("""
        import sys, torch
        m = torch.nn.MultiheadAttention  # unused; keeps imports honest
        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.qkv = torch.nn.Linear(16, 48)
            def forward(self, x):
                q, k, v = self.qkv(x).view(1, -1, 3, 2, 8).permute(2, 0, 3, 1, 4)
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        block = Block().eval()
        x = torch.randn(1, 5, 16)
        with torch.no_grad():
            out = torch.compile(block, backend="kvtopo", options={"inductor": False})(x)
            torch.testing.assert_close(out, block(x))
        import kvtopo.backend
        assert "kvtopo" in sys.modules and sum(len(r.sites) for r in kvtopo.backend.REPORTS) == 1
        print("OK")
    """)
    # The backend module is imported by Dynamo's entry-point lookup, before the test's own import.
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("OK")


def test_inspect_inside_a_session_leaves_its_history_alone():
    """Traced through a kvtopo-compiled model inside a session, inspect's tokens joined the
    model's history (and the next step attended to them)."""
    from kvtopo.models import zoo

    model = zoo.build("llama")
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=3, do_sample=False)
    kvtopo.compile(model, inductor=False)
    with kvtopo.session(kvtopo.Config.lossless()) as s:
        model(input_ids=ids[:, :8])
        report = kvtopo.inspect(model, torch.randint(0, 256, (1, 5)))
        assert s.stats().tokens == (8,) and len(report.sites) == 2
        s.clear()
        assert torch.equal(kvtopo.generate(model, ids, max_new_tokens=3), expected)


def test_replace_drops_the_energies_palu_implied():
    palu = kvtopo.Config(policy="palu")
    assert (palu.key_energy, palu.value_energy) == (0.9, 0.9)
    topo = palu.replace(policy="topo")
    assert topo.key_energy is None and topo.value_energy is None  # projection stays opt-in
    assert palu.replace(policy="kivi").key_energy is None
    assert palu.replace(page_size=16).key_energy == 0.9
    chosen = kvtopo.Config(policy="palu", key_energy=0.9, value_energy=0.9)
    assert chosen.replace(policy="topo").key_energy == 0.9  # the caller's own energies stay
    assert palu == chosen
    # One energy named: the other implied one goes too, as in a config built with the same fields.
    assert palu.replace(policy="topo", key_energy=0.8) == kvtopo.Config(policy="topo", key_energy=0.8)
    assert palu.replace(policy="snapkv", value_energy=None) == kvtopo.Config(policy="snapkv")


@pytest.mark.parametrize("args,kwargs,message", [
    ((None,), {}, "model is a NoneType"),
    (("llama",), {}, "model is a str"),
    ((torch.nn.Linear(2, 2),), {"inductor": "no"}, "inductor='no' is invalid"),
    ((torch.nn.Linear(2, 2),), {"dynamic": "x"}, "dynamic='x' is invalid"),
])
def test_compile_checks_its_arguments_before_the_first_forward(args, kwargs, message):
    with pytest.raises(TypeError, match=message):
        kvtopo.compile(*args, **kwargs)


def test_a_session_names_a_config_of_the_wrong_type():
    from kvtopo.runtime.session import Session

    for make in (kvtopo.session, Session):
        with pytest.raises(TypeError, match="takes a kvtopo.Config, got str"):
            make("topo")


@pytest.mark.parametrize("key_shape,value_shape,message", [
    ((1, 2, 5, 8), (1, 2, 5, 8), "do not fit together"),   # 5 tokens against the query's 6
    ((1, 3, 6, 8), (1, 3, 6, 8), "do not fit together"),   # 4 query heads over 3 kv-heads
    ((1, 2, 6, 4), (1, 2, 6, 8), "do not fit together"),   # key dim 4 against the query's 8
    ((2, 6, 8), (1, 2, 6, 8), "key \\(2, 6, 8\\) torch.float32"),
])
def test_attend_refuses_tensors_that_do_not_fit_before_storing(key_shape, value_shape, message):
    """Before, a lossless layer failed with torch's own size error, the layer was created and the
    sequence was then refused as 'stored in part' though nothing was stored."""
    q = torch.randn(1, 4, 6, 8)
    with kvtopo.session(kvtopo.Config.lossless()) as s:
        with pytest.raises(ValueError, match=message):
            s.attend("layer", q, torch.randn(*key_shape), torch.randn(*value_shape), None, 0.3)
        assert s.layers == {}
        s.attend("layer", q, torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8), None, 0.3)  # the sequence goes on
        assert s.stats().tokens == (6,)
