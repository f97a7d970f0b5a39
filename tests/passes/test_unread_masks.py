"""Masks whose structure a short chunk cannot show are refused at compile time.

Inside a session the op checks the graph's mask over each chunk, but a chunk no longer than a
block or window shows no more than causality: a block mask (Llama-4's `attention_chunk_size`), a
window written another way, or a prefix every query may see would pass that check and be dropped
on the history. The passes must prove the mask is causal order + padding + a window they read, and
refuse the rest with the comparison they could not read. Each accepted form is also checked for
exactness in a session, chunk by chunk, against one full forward.
"""

import pytest
import torch
import torch.nn.functional as F
import transformers

import kvtopo
from kvtopo.backend import RefusedAttention
from kvtopo.models import zoo
from kvtopo.models.blocks import _Projections
from masked_attention import MaskedAttention, token_indices


MASKS = {
    # accepted: causal order, written several ways
    "kv <= q": lambda q, kv: kv <= q,
    "q >= kv": lambda q, kv: q >= kv,
    "q - kv >= 0": lambda q, kv: q - kv >= 0,
    "0 <= q - kv": lambda q, kv: 0 <= q - kv,
    "kv - q <= 0": lambda q, kv: kv - q <= 0,
    "tril": lambda q, kv: torch.ones(q.shape[0], kv.shape[1], dtype=torch.bool).tril(),
    "causal, window 4 (HF form)": lambda q, kv: (kv <= q) & (kv > q - 4),
    "causal, window 4 as q - kv < 4": lambda q, kv: (kv <= q) & (q - kv < 4),
    "causal, window 4 as q - kv <= 3": lambda q, kv: (kv <= q) & (q - kv <= 3),
    "causal, window 4 as 4 > q - kv": lambda q, kv: (kv <= q) & (4 > q - kv),
    # refused: structure over absolute positions or distances the passes do not read
    "block of 4": lambda q, kv: (kv <= q) & (kv // 4 == q // 4),
    "window as kv + 4 > q": lambda q, kv: (kv <= q) & (kv + 4 > q),
    "prefix of 2": lambda q, kv: (kv <= q) | (kv < 2),
    "one key ahead (tril(1))": lambda q, kv: torch.ones(q.shape[0], kv.shape[1], dtype=torch.bool).tril(1),
    "block of 4, no comparison": lambda q, kv: (kv <= q) & ~((q // 4 - kv // 4).bool()),
    "prefix of 3 by clamp": lambda q, kv: kv <= q.clamp(min=3),
    "wider band 2 kv > q - 4": lambda q, kv: (kv <= q) & (2 * kv > q - 4),
    "lookahead kv <= q + t": lambda q, kv: kv <= q + torch.ones_like(q),
}
REFUSED = {"block of 4", "window as kv + 4 > q", "prefix of 2", "one key ahead (tril(1))", "block of 4, no comparison",
           "prefix of 3 by clamp", "wider band 2 kv > q - 4", "lookahead kv <= q + t"}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_the_passes_rewrite_only_masks_whose_whole_structure_they_read(name):
    block = MaskedAttention(MASKS[name]).eval()
    x = torch.randn(1, 12, 32)
    report = kvtopo.inspect(block, x[:, :3])  # 3 tokens: shorter than every block, window and prefix here
    compiled = torch.compile(block, backend="kvtopo", options={"inductor": False})
    with torch.no_grad():
        expected = block(x)
    if name in REFUSED:
        assert not report.sites and len(report.refusals) == 1
        assert "neither causal order, a sliding window nor padding" in report.refusals[0].reason
        with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()) as s:
            with pytest.raises(RefusedAttention):
                compiled(x[:, :3])
            assert s.stats().tokens == ()
        return
    assert len(report.sites) == 1 and not report.refusals
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless(page_size=2)):
        got = torch.cat([compiled(x[:, a:b]) for a, b in ((0, 3), (3, 4), (4, 9), (9, 10), (10, 11), (11, 12))], 1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", sorted(name for name in MASKS if "window 4" in name))
def test_a_window_is_read_as_the_keys_it_keeps(name):
    """Each form keeps a query's own key and the 3 before it: a window of 4 tokens, which the
    session applies to the history (the chunks above check it against the model)."""
    report = kvtopo.inspect(MaskedAttention(MASKS[name]).eval(), torch.randn(1, 3, 32))
    assert [s.window for s in report.sites] == [4]


def _llama4_chunked(attn_implementation: str):
    """Tiny Llama-4 text model: layer 0 attends in blocks of 8 tokens (`attention_chunk_size`),
    layer 1 (no RoPE) over the whole sequence."""
    config = transformers.Llama4TextConfig(
        hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256, attention_chunk_size=8,
        num_local_experts=1, no_rope_layers=[1, 0])
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    return transformers.Llama4ForCausalLM(config).eval()


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_llama4_block_attention_is_refused_even_when_the_prompt_fits_one_block(attn_implementation):
    """An 8-token prompt shows a causal mask; decoding past token 8 the model attends only within
    its block. Before this refusal, a session attended over the whole history (logits off by ~1.7)."""
    model = _llama4_chunked(attn_implementation)
    ids = torch.randint(0, 200, (1, 8), generator=torch.Generator().manual_seed(1))
    report = kvtopo.inspect(model, input_ids=ids, use_cache=False)
    assert [r.layer for r in report.refusals] == ["model.layers.0.self_attn"]
    assert "eq(floordiv(" in report.refusals[0].reason
    assert [s.layer for s in report.sites] == ["model.layers.1.self_attn"]
    with pytest.raises(RefusedAttention, match="model.layers.0.self_attn"):
        kvtopo.generate(kvtopo.compile(model, inductor=False), ids, max_new_tokens=12, config=kvtopo.Config.lossless())


ANTI_CAUSAL = {  # every query sees itself and the keys after it: a cache cannot hold the future
    "kv >= q": lambda q, kv: kv >= q,
    "q <= kv": lambda q, kv: q <= kv,
    "kv - q >= 0": lambda q, kv: kv - q >= 0,
}


@pytest.mark.parametrize("name", sorted(ANTI_CAUSAL))
def test_order_comparisons_facing_the_future_are_refused(name):
    """A one-token prompt shows the session nothing wrong (its one key is its own); the shapes of
    the comparison's operands show which is the query's index and which the key's."""
    block = MaskedAttention(ANTI_CAUSAL[name]).eval()
    report = kvtopo.inspect(block, torch.randn(1, 3, 32))
    assert not report.sites and "neither causal order" in report.refusals[0].reason


def test_a_band_facing_the_future_is_not_read_as_a_window():
    """`q > kv - 4` bounds keys ahead of the query, not behind it: with `kv <= q` the mask is plain
    causal. Read as a window of 4 it would have hidden the older history on short chunks."""
    block = MaskedAttention(lambda q, kv: (kv <= q) & (q > kv - 4)).eval()
    report = kvtopo.inspect(block, torch.randn(1, 3, 32))
    assert [s.window for s in report.sites] == [] and "neither causal order" in report.refusals[0].reason


class TableMask(_Projections):
    """Keys kept by a table the module holds (a buffer), looked up by token index."""

    def __init__(self):
        super().__init__()
        self.register_buffer("keep", torch.arange(64) % 3 != 1)

    def forward(self, x):
        q, k, v = self.qkv(x)
        qi, ki = token_indices(x)
        mask = (ki <= qi) & self.keep[ki]
        return self.out(F.scaled_dot_product_attention(q, self.repeat_kv(k), self.repeat_kv(v), attn_mask=mask))


def test_a_mask_read_from_the_models_buffers_is_refused():
    """The table's values beyond the chunk cannot be proven causal (GPT-Neo keeps its local band
    in a buffer the same way)."""
    report = kvtopo.inspect(TableMask().eval(), torch.randn(1, 3, 32))
    assert not report.sites and "a tensor of the model" in report.refusals[0].reason


class BlockIdTable(_Projections):
    """Blocks of 4 tokens written as a lookup: a buffer of block ids read at the query and at the key."""

    def __init__(self):
        super().__init__()
        self.register_buffer("block_id", torch.arange(64) // 4)

    def forward(self, x):
        q, k, v = self.qkv(x)
        qi, ki = token_indices(x)
        mask = (ki <= qi) & (self.block_id[ki] == self.block_id[qi])
        return self.out(F.scaled_dot_product_attention(q, self.repeat_kv(k), self.repeat_kv(v), attn_mask=mask))


def test_ids_compared_at_query_and_key_pass_only_as_hfs_packed_sequence_ids():
    """HF's packed-sequence ids (a cumsum of where the call's position_ids restart; built for a
    forward without a cache) are compared at the query and at the key, and accepted. The same
    comparison over a table the model keeps is a block mask a 3-token chunk cannot show: refused."""
    report = kvtopo.inspect(BlockIdTable().eval(), torch.randn(1, 3, 32))
    assert not report.sites and "neither causal order" in report.refusals[0].reason
    report = kvtopo.inspect(zoo.build("llama", "eager"), input_ids=torch.randint(0, 256, (1, 3)), use_cache=False)
    assert len(report.sites) == 2 and not report.refusals
