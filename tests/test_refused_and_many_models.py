"""What a session does with attention it cannot rewrite, and with several compiled models."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kvtopo
from kvtopo.backend import RefusedAttention
from kvtopo.models import zoo
from kvtopo.models.blocks import SDPACausal, _Projections


class SoftcapAroundMask(_Projections):
    """Refused: the causal mask is added inside the softcap's tanh."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        t = x.shape[1]
        scores = torch.matmul(q, self.repeat_kv(k).transpose(2, 3)) / math.sqrt(self.head_dim)
        scores = torch.tanh((scores + torch.full((t, t), -1e9).triu(1)) / 3.0) * 3.0
        return self.out(torch.matmul(F.softmax(scores, dim=-1), self.repeat_kv(v)))


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = SDPACausal(seed=1), SoftcapAroundMask(seed=2)

    def forward(self, x):
        return self.second(x + self.first(x))


def test_a_partly_refused_model_raises_in_a_session_before_any_compute():
    model = TwoLayers().eval()
    x = torch.randn(1, 9, 32)
    report = kvtopo.inspect(model, x)
    assert len(report.sites) == 1 and len(report.refusals) == 1
    compiled = torch.compile(model, backend="kvtopo", options={"inductor": False})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=0)  # unchanged outside
        with kvtopo.session(kvtopo.Config.lossless()) as s:
            with pytest.raises(RefusedAttention, match="second.*inside the logit softcap"):
                compiled(x)
            assert s.calls == 0 and s.stats().tokens == ()


class RefusedOnlyLM(nn.Module):
    """A tiny language model whose every attention (a mask inside the softcap) is refused."""

    def __init__(self, vocab: int = 64):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, 32)
        self.blocks = nn.ModuleList([SoftcapAroundMask(seed=3), SoftcapAroundMask(seed=4)])
        self.head = nn.Linear(32, vocab, bias=False)

    def get_input_embeddings(self):
        return self.embed

    def forward(self, input_ids, position_ids=None, use_cache=False, attention_mask=None):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = x + block(x)
        return (self.head(x),)


def _greedy_recompute(model, ids, steps):
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(ids, use_cache=False)[0][:, -1].argmax(-1, keepdim=True)], 1)
    return ids


def test_a_model_with_every_site_refused_generates_uncompressed_with_a_warning():
    """A mask inside the softcap is not a pattern the passes accept: nothing is rewritten."""
    model = RefusedOnlyLM().eval()
    ids = torch.randint(0, 64, (1, 48), generator=torch.Generator().manual_seed(6))
    expected = _greedy_recompute(model, ids, 24)
    report = kvtopo.inspect(model, ids[:, :8], use_cache=False)
    assert not report.sites and len(report.refusals) == len(model.blocks)
    compiled = kvtopo.compile(model, inductor=False)
    with pytest.warns(UserWarning, match="nothing is compressed"):
        tokens = kvtopo.generate(compiled, ids, 24, config=kvtopo.Config.lossless())
    assert torch.equal(tokens, expected)


def test_a_bidirectional_model_falls_back_and_says_why_it_cannot_generate():
    """RoFormer built without is_decoder=True attends both ways: refused (its mask is not causal),
    and its own forward returns no cache, so the fallback cannot generate either; the error names both."""
    import transformers

    config = transformers.RoFormerConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=64, embedding_size=32)
    model = kvtopo.compile(transformers.RoFormerForCausalLM(config).eval(), inductor=False)
    ids = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="nothing is compressed"), \
            pytest.raises(RuntimeError, match="neither causal order.*returned no cache.*is_decoder=False"):
        kvtopo.generate(model, ids, 3, config=kvtopo.Config.lossless())



def test_a_model_whose_generation_hf_prepares_its_own_way_and_that_takes_no_cache_is_refused():
    """XLNet's attention is refused (einsum scores) and its forward takes `mems`, not a cache; HF's
    generate predicts each token through a dummy token, a permutation mask and the mems it carries,
    which a recompute of the whole sequence does not give (before: other tokens than HF's, no error)."""
    import transformers

    config = transformers.XLNetConfig(vocab_size=160, d_model=64, n_layer=2, n_head=4, d_inner=128, pad_token_id=0,
                                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = kvtopo.compile(transformers.XLNetLMHeadModel(config).eval(), inductor=False)
    ids = torch.randint(3, 150, (1, 5), generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="nothing is compressed"), \
            pytest.raises(ValueError, match="XLNetLMHeadModel's forward takes no cache.*use model.generate"):
        kvtopo.generate(model, ids, 4, config=kvtopo.Config.lossless(), eos_token_id=None)


def test_a_model_whose_own_step_preparation_adds_nothing_is_recomputed_not_refused():
    """openai-gpt also writes its own `prepare_inputs_for_generation`, which hands the sequence on
    unchanged: HF's generate recomputes it as the fallback does, so it is not refused."""
    import transformers

    from kvtopo.generate import _fed_as_it_is

    gpt = transformers.OpenAIGPTLMHeadModel(transformers.OpenAIGPTConfig(vocab_size=64, n_positions=32, n_embd=32,
                                                                         n_layer=1, n_head=2))
    xlnet = transformers.XLNetLMHeadModel(transformers.XLNetConfig(vocab_size=64, d_model=32, n_layer=1, n_head=2,
                                                                   d_inner=64))
    assert _fed_as_it_is(gpt) and not _fed_as_it_is(xlnet)

class SharedAcrossAGraphBreak(nn.Module):
    """One attention module called twice per forward (weights shared, as in ALBERT) with a graph
    break between the calls: both graphs name the site alike."""

    def __init__(self, vocab: int = 64):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.block, self.head = nn.Embedding(vocab, 32), SDPACausal(seed=1), nn.Linear(32, vocab)

    def forward(self, input_ids, position_ids=None, use_cache=False, attention_mask=None):
        x = self.embed(input_ids)
        x = x + self.block(x)
        torch._dynamo.graph_break()
        return (self.head(x + self.block(x)),)


def test_a_site_called_twice_in_one_forward_raises():
    """Its two calls would share one store: each forward's second call would attend over the first's
    tokens as history. Through kvtopo.compile's forward and kvtopo.generate's steps it raises."""
    model = SharedAcrossAGraphBreak().eval()
    ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(2))
    compiled = kvtopo.compile(model, inductor=False)
    with torch.no_grad(), pytest.raises(RuntimeError, match="'model[0-9]*/block' ran twice in one forward"):
        kvtopo.generate(compiled, ids, 4, config=kvtopo.Config.lossless())
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()) as s:
        with pytest.raises(RuntimeError, match="ran twice in one forward"):
            compiled(ids)
        assert s.calls == 1


def test_two_models_in_one_session_keep_separate_stores():
    """A draft and a target model (same architecture, same layer names) in one session."""
    draft, target = zoo.build("llama", seed=1), zoo.build("llama", seed=2)
    ids = torch.randint(0, 256, (1, 50), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = {name: m(ids, use_cache=False).logits for name, m in (("draft", draft), ("target", target))}
    compiled = {"draft": kvtopo.compile(draft, inductor=False), "target": kvtopo.compile(target, inductor=False)}
    got = {"draft": [], "target": []}
    cuts = [(0, 20), (20, 21), (21, 22), (22, 50)]
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless(page_size=8)) as s:
        for a, b in cuts:
            for name, model in compiled.items():  # interleaved: each step of one, then of the other
                out = model(input_ids=ids[:, a:b], position_ids=torch.arange(a, b)[None], use_cache=False)
                got[name].append(out.logits)
        stats = s.stats()
    for name in got:
        torch.testing.assert_close(torch.cat(got[name], 1), expected[name], atol=1e-4, rtol=0)
    models = {layer.split("/")[0] for layer in stats.per_layer}
    assert len(models) == 2 and len(stats.per_layer) == 2 * zoo.num_attention_layers(draft)
    assert all(held == (50,) for held in stats.held_tokens.values())


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_a_second_model_of_the_same_class_with_another_scale_is_still_rewritten(attn_implementation, monkeypatch):
    """Dynamo makes a float attribute that changed between compiles of one class a graph input
    (the second Llama's attention scale): the op takes it as its scale; before, those sites were
    refused ("scale is not a constant") and the second model ran uncompressed."""
    import kvtopo.backend as backend

    reports = []
    run_passes = backend.run_passes
    monkeypatch.setattr(backend, "run_passes", lambda gm: reports.append(run_passes(gm)) or reports[-1])
    torch._dynamo.reset()
    ids = torch.randint(0, 200, (1, 12), generator=torch.Generator().manual_seed(3))
    for head_dim in (16, 32):
        model = zoo.build("llama", attn_implementation, head_dim=head_dim)
        with torch.no_grad():
            expected = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        with kvtopo.session(kvtopo.Config.lossless()) as s:
            got = kvtopo.generate(kvtopo.compile(model, inductor=False), ids, max_new_tokens=6)
            assert s.stats().tokens == (17,)  # stored by the session: compressed path, not the fallback
        assert torch.equal(got, expected)
    assert not any(r.refusals for r in reports)
    assert any(isinstance(site.scale, torch.fx.Node) for r in reports for site in r.sites)


class LearnedPrefix(_Projections):
    """Refused: two learned key/value rows joined before the chunk's own (prefix tuning)."""

    def __init__(self):
        super().__init__()
        self.prefix_k = nn.Parameter(torch.randn(1, self.kv_heads, 2, self.head_dim))
        self.prefix_v = nn.Parameter(torch.randn(1, self.kv_heads, 2, self.head_dim))

    def forward(self, x):
        q, k, v = self.qkv(x)
        b = x.shape[0]
        k = torch.cat([self.prefix_k.expand(b, -1, -1, -1), k], 2)
        v = torch.cat([self.prefix_v.expand(b, -1, -1, -1), v], 2)
        return self.out(F.scaled_dot_product_attention(q, self.repeat_kv(k), self.repeat_kv(v), is_causal=True))


def test_keys_beyond_the_chunks_own_tokens_are_refused_with_the_reason():
    """Before: accepted, and a session failed mid-forward on a shape mismatch."""
    block = LearnedPrefix().eval()
    x = torch.randn(1, 10, 32)
    report = kvtopo.inspect(block, x)
    assert not report.sites and "12 keys for 10 queries" in report.refusals[0].reason
    compiled = torch.compile(block, backend="kvtopo", options={"inductor": False})
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()) as s:
        with pytest.raises(RefusedAttention, match="keys for 6 queries"):
            compiled(x[:, :6])
        assert s.stats().tokens == ()
