"""A compiled model called in a session without position_ids continues RoPE positions from its store."""

import pytest
import torch

import kvtopo
from kvtopo.backend import REPORTS, kvtopo_backend
from kvtopo.models import zoo

POSITIONS = torch.ops.kvtopo.positions.default


def _ids(seed=1, length=71):
    return torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(seed))


def _full_logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


@pytest.mark.parametrize("impl,inductor", [(impl, False) for impl in zoo.ATTN_IMPLEMENTATIONS] + [("sdpa", True)])
def test_chunks_without_position_ids_continue_from_the_store(impl, inductor):
    model = zoo.build("llama", impl)
    ids = _ids()
    expected = _full_logits(model, ids)
    kvtopo.compile(model, inductor=inductor)
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()) as s:
        first = model(input_ids=ids[:, :40]).logits
        second = model(input_ids=ids[:, 40:70]).logits
        step = model(input_ids=ids[:, 70:71]).logits
        assert s.stats().tokens == (71,)
    torch.testing.assert_close(first, expected[:, :40], atol=1e-4, rtol=0)
    torch.testing.assert_close(second, expected[:, 40:70], atol=1e-4, rtol=0)
    torch.testing.assert_close(step, expected[:, 70:71], atol=1e-4, rtol=0)


def test_chunks_without_a_cache_object_at_all():
    """use_cache=False: HF builds no DynamicCache and checks the positions for packed sequences."""
    model = zoo.build("llama", "eager")
    ids = _ids(seed=2, length=50)
    expected = _full_logits(model, ids)
    kvtopo.compile(model, inductor=False)
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()):
        model(input_ids=ids[:, :20], use_cache=False)
        second = model(input_ids=ids[:, 20:50], use_cache=False).logits
    torch.testing.assert_close(second, expected[:, 20:50], atol=1e-4, rtol=0)


def test_two_models_in_one_session_keep_their_own_offsets():
    a, b = zoo.build("llama", seed=0), zoo.build("llama", seed=1)
    ids_a, ids_b = _ids(seed=3, length=60), _ids(seed=4, length=45)
    expected_a, expected_b = _full_logits(a, ids_a), _full_logits(b, ids_b)
    assert not torch.allclose(expected_a[:, :45], expected_b, atol=1e-3)
    kvtopo.compile(a, inductor=False)
    kvtopo.compile(b, inductor=False)
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()) as s:
        got_a = [a(input_ids=ids_a[:, :25]).logits]
        got_b = [b(input_ids=ids_b[:, :10]).logits]
        got_a.append(a(input_ids=ids_a[:, 25:59]).logits)
        got_b.append(b(input_ids=ids_b[:, 10:44]).logits)
        got_b.append(b(input_ids=ids_b[:, 44:45]).logits)
        got_a.append(a(input_ids=ids_a[:, 59:60]).logits)
        layers = sorted(s.stats().per_layer)
    torch.testing.assert_close(torch.cat(got_a, 1), expected_a, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.cat(got_b, 1), expected_b, atol=1e-4, rtol=0)
    tags = {layer.split("/", 1)[0] for layer in layers}
    assert len(tags) == 2 and len(layers) == 4, layers
    for tag in tags:
        assert sorted(l.split("/", 1)[1] for l in layers if l.startswith(tag + "/")) == \
            ["model.layers.0.self_attn", "model.layers.1.self_attn"]


def _graphs(model, **kwargs):
    graphs = []

    def backend(gm, example_inputs):
        compiled = kvtopo_backend(gm, example_inputs, options={"inductor": False})
        graphs.append(gm)
        return compiled

    REPORTS.clear()
    with torch.no_grad():
        torch.compile(model, backend=backend)(**kwargs)
    return graphs


def _count(graphs, target):
    return sum(1 for g in graphs for n in g.graph.nodes if n.op == "call_function" and n.target == target)


def test_one_positions_op_only_when_the_graph_computes_positions_from_zero():
    model = zoo.build("llama")
    ids = _ids(length=12)
    graphs = _graphs(model, input_ids=ids)
    assert len(graphs) == 1
    assert _count(graphs, POSITIONS) == 1
    assert _count(graphs, torch.ops.kvtopo.attention.default) == 2
    assert [r.positions for r in REPORTS] == [1]
    assert len(REPORTS[0].sites) == 2  # positions are not attention sites
    positions = next(n for n in graphs[0].graph.nodes if n.target == POSITIONS)
    attention = next(n for n in graphs[0].graph.nodes if n.target == torch.ops.kvtopo.attention.default)
    assert positions.args[1] is attention.args[-1] and positions.args[1].op == "placeholder"  # the model key

    torch._dynamo.reset()
    graphs = _graphs(model, input_ids=ids, position_ids=torch.arange(12)[None])
    assert _count(graphs, POSITIONS) == 0
    assert _count(graphs, torch.ops.kvtopo.attention.default) == 2
    assert [r.positions for r in REPORTS] == [0]


def test_a_batch_whose_rows_are_all_padded_continues_from_its_columns():
    """HF's cache counts columns, padding included: a chunk after a prompt whose every row is
    left-padded (padded to a multiple, say) continues at the prompt's column count, not at the
    longest row's stored tokens (before, positions fell short by the least padding)."""
    model = zoo.build("llama")
    ids = _ids(seed=11, length=30).repeat(2, 1)
    ids[1] = _ids(seed=12, length=30)[0]
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[0, :3], mask[1, :5] = 0, 0
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    kvtopo.compile(model, inductor=False)
    got, tokens = _padded_chunks(model, ids, mask, ((0, 12), (12, 29), (29, 30)))
    assert tokens == (27, 25)
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-4, rtol=0)


def _padded_chunks(model, ids, mask, cuts):
    """The logits of a left-padded batch fed in chunks `cuts` through a lossless session, each
    step marking its padding, and the tokens each row stored."""
    chunks = []
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()) as s:
        for a, b in cuts:
            with s.step(mask[:, a:b].bool()):
                chunks.append(model(input_ids=ids[:, a:b], attention_mask=mask[:, a:b]).logits)
        return torch.cat(chunks, 1), s.stats().tokens


GIVEN = torch.ops.kvtopo.given_positions.default


def test_given_positions_are_checked_and_a_restart_over_a_stored_history_raises():
    """`position_ids` passed in go through `kvtopo.given_positions` (the token ids, which pick rows
    of a table too, do not): continuing positions are exact, a restart at 0 over the stored tokens
    raises, and after `clear()` the same call is a new sequence."""
    model = zoo.build("llama", "eager")
    graphs = _graphs(model, input_ids=_ids(length=12), position_ids=torch.arange(12)[None])
    given = [n for g in graphs for n in g.graph.nodes if n.target == GIVEN]
    assert [r.given_positions for r in REPORTS] == [1] and [r.positions for r in REPORTS] == [0]
    assert len(given) == 1 and "position_ids" in given[0].args[0].name
    ids = _ids(seed=5, length=50)
    expected = _full_logits(model, ids)
    torch._dynamo.reset()
    kvtopo.compile(model, inductor=False)
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()) as s:
        chunks = [model(input_ids=ids[:, a:b], position_ids=torch.arange(a, b)[None]).logits
                  for a, b in ((0, 20), (20, 49), (49, 50))]
        with pytest.raises(RuntimeError, match="numbers its 30 token.s. from 0 while the session holds 50"):
            model(input_ids=ids[:, :30], position_ids=torch.arange(30)[None])
        assert s.stats().tokens == (50,)  # nothing stored by the refused forward
        s.clear()
        again = model(input_ids=ids[:, :30], position_ids=torch.arange(30)[None]).logits
    torch.testing.assert_close(torch.cat(chunks, 1), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(again, expected[:, :30], atol=1e-4, rtol=0)


def test_generate_without_a_cache_in_a_session_raises():
    """HF `generate(use_cache=False)` feeds the whole sequence from position 0 every step: inside a
    session that stores each step's tokens again, so its second step raises (outside one it runs)."""
    model = zoo.build("llama")
    ids = _ids(seed=6, length=12)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=3, do_sample=False, use_cache=False)
    kvtopo.compile(model, inductor=False)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False, use_cache=False), expected)
        with kvtopo.session(kvtopo.Config.lossless()), pytest.raises(RuntimeError, match="from 0 while the session"):
            model.generate(ids, max_new_tokens=3, do_sample=False, use_cache=False)


def test_positions_a_graph_break_leaves_in_another_graph_are_checked():
    """CTRL counts its positions, then breaks the graph before its table lookup: the count reaches
    the attention's graph as an input. Without `position_ids` a second chunk restarts at 0 and
    raises; `kvtopo.generate`, which passes them, equals HF's tokens."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.CTRLConfig(n_layer=2, n_head=4, n_embd=64, dff=128, vocab_size=256, n_positions=256)
    model = transformers.CTRLLMHeadModel(config).eval()
    ids = _ids(seed=8, length=24)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=4, do_sample=False)
    kvtopo.compile(model, inductor=False)
    with torch.no_grad():
        with kvtopo.session(kvtopo.Config.lossless()):
            model(input_ids=ids[:, :12])
            assert any(r.given_positions for r in REPORTS), REPORTS
            with pytest.raises(RuntimeError, match="from 0 while the session holds 12"):
                model(input_ids=ids[:, 12:])
        with kvtopo.session(kvtopo.Config.lossless()):
            assert torch.equal(kvtopo.generate(model, ids, max_new_tokens=4), expected)


def test_rotary_cos_sin_a_graph_break_leaves_in_another_graph_are_checked():
    """DBRX's blocks compile to graphs of their own (its experts break the graph): the rotary cos/sin
    reach them as inputs, counted from 0 in the model's graph. A second chunk without
    `position_ids` starts at 0 again and raises; `kvtopo.generate` equals HF's tokens (its many
    frames share one code object, transformers' decorator, so Dynamo's recompile limit is raised)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.DbrxConfig(
        d_model=64, n_heads=4, n_layers=2, max_seq_len=256, vocab_size=256,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2})
    model = transformers.DbrxForCausalLM(config).eval()
    ids = _ids(seed=9, length=24)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=4, do_sample=False)
    kvtopo.compile(model, inductor=False)
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=64):
        with kvtopo.session(kvtopo.Config.lossless()):
            model(input_ids=ids[:, :12])
            assert any(r.given_positions for r in REPORTS), REPORTS
            with pytest.raises(RuntimeError, match="from 0 while the session holds 12"):
                model(input_ids=ids[:, 12:])
        with kvtopo.session(kvtopo.Config.lossless()):
            assert torch.equal(kvtopo.generate(model, ids, max_new_tokens=4), expected)


def test_token_indices_that_only_pick_experts_are_not_positions():
    """Qwen3-MoE numbers its tokens `arange(T)` to dispatch them to experts, and that count reaches
    an index into the experts' weights, but only through a sort: not a position table."""
    model = zoo.build("qwen3-moe")
    graphs = _graphs(model, input_ids=_ids(length=12))
    assert _count(graphs, torch.ops.kvtopo.attention.default) == 2
    assert _count(graphs, POSITIONS) == 1  # the rotary positions only
    ids = _ids(seed=7, length=30)
    expected = _full_logits(model, ids)
    torch._dynamo.reset()
    kvtopo.compile(model, inductor=False)
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()):
        chunks = [model(input_ids=ids[:, :17]).logits, model(input_ids=ids[:, 17:]).logits]
    torch.testing.assert_close(torch.cat(chunks, 1), expected, atol=1e-4, rtol=0)


def test_positions_op_is_identity_outside_a_session_and_shifts_inside():
    x = torch.arange(5)
    model, other = zoo.build("llama"), zoo.build("llama", seed=1)
    # the model key: the first parameter the graph reads that is not an embedding table
    key, other_key = (m.model.layers[0].input_layernorm.weight for m in (model, other))
    assert torch.equal(POSITIONS(x, key), x)
    kvtopo.compile(model, inductor=False)
    ids = _ids(length=9)
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()):
        model(input_ids=ids)
        assert torch.equal(POSITIONS(x, key), x + 9)
        assert torch.equal(POSITIONS(x, other_key), x)  # another model: nothing stored for it
    assert torch.equal(POSITIONS(x, key), x)


def test_compiled_model_outside_a_session_is_unchanged():
    """(Inductor outside a session: tests/passes/test_zoo_sites.py; in one, the chunks above.)"""
    model = zoo.build("llama")
    ids = _ids(length=30)
    expected, expected_middle = _full_logits(model, ids), _full_logits(model, ids[:, 10:20])
    kvtopo.compile(model, inductor=False)
    with torch.no_grad():
        for _ in range(2):  # no state carries over between calls outside a session
            torch.testing.assert_close(model(input_ids=ids).logits, expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(model(input_ids=ids[:, 10:20]).logits, expected_middle, atol=1e-5, rtol=0)


class _PositionsModule(torch.nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op
        self.weight = torch.nn.Parameter(torch.ones(2))

    def forward(self, x):
        return self.op(x, self.weight) * 2


@pytest.mark.parametrize("op", [POSITIONS, GIVEN])
def test_positions_ops_export_and_decompose_to_identity(op):
    from kvtopo.kernels.ops import DECOMPOSITIONS

    x = torch.arange(6)
    program = torch.export.export(_PositionsModule(op), (x,))
    assert any(n.target is op for n in program.graph.nodes)
    decomposed = program.run_decompositions(DECOMPOSITIONS)
    assert not any("kvtopo" in str(n.target) for n in decomposed.graph.nodes)
    assert torch.equal(decomposed.module()(x), x * 2)


def _learned_positions_model(name: str, impl: str) -> torch.nn.Module:
    """A tiny model whose positions index a table the model holds (no RoPE)."""
    import transformers

    if name == "gpt2":
        return zoo.build("gpt2", impl)
    small = dict(vocab_size=256, max_position_embeddings=256, pad_token_id=1, bos_token_id=None, eos_token_id=None)
    config = {
        "opt": lambda: transformers.OPTConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, ffn_dim=128,
                                              word_embed_proj_dim=64, dropout=0.0, **small),
        "biogpt": lambda: transformers.BioGptConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=64,
                                                    intermediate_size=128, hidden_dropout_prob=0.0, **small),
        "gpt_bigcode": lambda: transformers.GPTBigCodeConfig(n_layer=2, n_head=4, n_embd=64, n_positions=256,
                                                             vocab_size=256, bos_token_id=None, eos_token_id=None),
        "roformer": lambda: transformers.RoFormerConfig(  # its rotary sin/cos are rows of a sinusoidal table
            hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128, vocab_size=256,
            embedding_size=64, max_position_embeddings=256, is_decoder=True, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, pad_token_id=0),
        # BERT and RoBERTa as decoders: BERT slices a buffer holding 0, 1, 2, ...; RoBERTa counts its
        # token ids that are not padding, from padding_idx + 1
        **{name: (lambda cls=cls: cls(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128,
                                      is_decoder=True, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                      **small))
           for name, cls in (("bert", transformers.BertConfig), ("roberta", transformers.RobertaConfig))},
    }[name]()
    config._attn_implementation = impl
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("name,impl", [("gpt2", "sdpa"), ("gpt2", "eager"), ("opt", "eager"), ("biogpt", "sdpa"),
                                       ("gpt_bigcode", "sdpa"), ("roformer", "eager"), ("bert", "sdpa")])
def test_learned_position_tables_continue_from_the_store(name, impl):
    """GPT-2 / GPTBigCode / BioGPT number a chunk `arange(T) + 0`, OPT counts a mask of ones, BERT
    takes its `position_ids` buffer's first T; the table rows they pick must continue from the
    store as they do from HF's cache."""
    model = _learned_positions_model(name, impl)
    ids = _ids(seed=5, length=50)
    expected = _full_logits(model, ids)
    REPORTS.clear()
    kvtopo.compile(model, inductor=False)
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()) as s:
        chunks = [model(input_ids=ids[:, a:b]).logits for a, b in ((0, 20), (20, 49), (49, 50))]
        assert s.stats().tokens == (50,)
    assert all(r.positions == 1 for r in REPORTS) and not any(r.refusals for r in REPORTS), REPORTS
    torch.testing.assert_close(torch.cat(chunks, 1), expected, atol=1e-4, rtol=0)


def test_a_count_of_the_token_ids_raises_on_the_next_chunk_and_generate_equals_hf():
    """RoBERTa counts its token ids that are not padding (from padding_idx + 1), a count kvtopo
    cannot continue: a second chunk without `position_ids` raises instead of restarting;
    `kvtopo.generate` passes them, as HF's generate does, and gives HF's logits."""
    model = _learned_positions_model("roberta", "sdpa")
    ids = _ids(seed=6, length=20).clamp(min=2)  # no padding id (1) in the prompt: HF's generate would mask it
    with torch.no_grad():
        expected = model(ids).logits
        hf = model.generate(ids[:, :12], max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=1,
                            output_scores=True, return_dict_in_generate=True)
    kvtopo.compile(model, inductor=False)
    with torch.no_grad():
        with kvtopo.session(kvtopo.Config.lossless()):
            torch.testing.assert_close(model(input_ids=ids[:, :12]).logits, expected[:, :12], atol=1e-4, rtol=0)
            with pytest.raises(RuntimeError, match="numbers its 8 token.*while the session holds 12.*pass position_ids"):
                model(input_ids=ids[:, 12:])
        out, logits = kvtopo.generate(model, ids[:, :12], 8, config=kvtopo.Config.lossless(), return_logits=True,
                                      eos_token_id=None, do_sample=False, prefill_chunk_size=5)
    assert torch.equal(out, hf.sequences)
    torch.testing.assert_close(logits, torch.stack(hf.scores, 1), atol=1e-4, rtol=0)


def test_a_count_of_the_callers_mask_continues_from_the_store():
    """OPT given the chunk's `attention_mask` (as a tokenizer returns it) counts that mask: the count
    of a graph input is continued as the count of ones built in the graph is."""
    model = _learned_positions_model("opt", "eager")
    ids = _ids(seed=11, length=30)
    expected = _full_logits(model, ids)
    kvtopo.compile(model, inductor=False)
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()):
        chunks = [model(input_ids=ids[:, a:b], attention_mask=torch.ones(1, b - a, dtype=torch.long)).logits
                  for a, b in ((0, 13), (13, 29), (29, 30))]
    torch.testing.assert_close(torch.cat(chunks, 1), expected, atol=1e-4, rtol=0)


def test_a_count_of_a_padded_rows_mask_continues_from_its_stored_tokens():
    """OPT numbers a row's real tokens (its mask's count); a left-padded row's chunks must continue
    from the tokens it stores, not from the batch's columns, which count its padding too."""
    model = _learned_positions_model("opt", "eager")
    ids = torch.cat([_ids(seed=12, length=30), _ids(seed=13, length=30)])
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[0, :5] = 0
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, use_cache=False).logits
    kvtopo.compile(model, inductor=False)
    got, _ = _padded_chunks(model, ids, mask, ((0, 13), (13, 29), (29, 30)))
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-4, rtol=0)


def test_a_count_that_includes_the_cache_length_is_not_shifted_again():
    """Through HF's cache API (`SessionCache`) OPT counts ones over past + T tokens and slices at the
    cache's length: already continued, so it must not be shifted by the store once more."""
    from kvtopo.hf_cache import SessionCache

    model = _learned_positions_model("opt", "eager")
    ids = _ids(seed=6, length=30)
    expected = _full_logits(model, ids)
    kvtopo.compile(model, inductor=False)
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()) as s:
        cache = SessionCache(s, model=model)
        first = model(input_ids=ids[:, :18], past_key_values=cache).logits
        second = model(input_ids=ids[:, 18:], past_key_values=cache).logits
    torch.testing.assert_close(torch.cat([first, second], 1), expected, atol=1e-4, rtol=0)


def _deepseek_v2():
    import transformers

    config = transformers.DeepseekV2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=256, max_position_embeddings=512, head_dim=8, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.DeepseekV2ForCausalLM(config).eval()


def test_complex_rotary_positions_continue_from_the_store():
    """DeepSeek-V2 (and Llama-4) rotate with complex numbers, `polar(1, positions * inv_freq)`, and no
    cos/sin: their positions are continued too."""
    model = _deepseek_v2()
    ids = _ids(seed=8, length=40)
    expected = _full_logits(model, ids)
    REPORTS.clear()
    kvtopo.compile(model, inductor=False)
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()):
        chunks = [model(input_ids=ids[:, a:b]).logits for a, b in ((0, 17), (17, 39), (39, 40))]
    assert all(r.positions == 1 for r in REPORTS if r.sites), REPORTS
    torch.testing.assert_close(torch.cat(chunks, 1), expected, atol=1e-4, rtol=0)


class _TableBlock(torch.nn.Module):
    """Positions `arange(0, T)` picking rows of a buffer cast first, `table.to(dtype)[pos, :]` (CTRL's
    sinusoidal table), then causal SDPA."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(256, 32)
        self.register_buffer("table", torch.randn(128, 32))
        self.qkv = torch.nn.Linear(32, 96)
        self.head = torch.nn.Linear(32, 256)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        positions = torch.arange(0, input_ids.shape[1], dtype=torch.long)[None]
        x = x + self.table.to(x.dtype)[positions, :]
        q, k, v = (t.view(1, -1, 4, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(y.transpose(1, 2).reshape(1, -1, 32))


class _OffsetRotaryBlock(_TableBlock):
    """Rotary positions `arange(T)[None, :] + offset`, the caller passing the stored length as `offset`."""

    def forward(self, input_ids, offset=0):
        x = self.embed(input_ids)
        positions = torch.arange(input_ids.shape[1])[None, :] + offset
        angles = positions[..., None].float() * torch.logspace(0, -2, 4)
        cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
        q, k, v = (t.view(1, -1, 4, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        q, k = (z * cos + torch.cat([-z[..., 4:], z[..., :4]], -1) * sin for z in (q, k))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(y.transpose(1, 2).reshape(1, -1, 32))


def test_an_offset_the_caller_adds_after_a_view_is_not_added_again():
    """The caller's start, added after a view of the count, makes the positions the caller's: the
    pass took the count for one starting at 0 (it looked for the add among the count's own users
    only) and the store's length was added a second time."""
    model = _OffsetRotaryBlock().eval()
    ids = _ids(seed=9, length=30)
    with torch.no_grad():
        expected = model(ids)
    compiled = torch.compile(model, backend="kvtopo")
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()):
        chunks = [compiled(ids[:, a:b], offset=a) for a, b in ((0, 11), (11, 29), (29, 30))]
    torch.testing.assert_close(torch.cat(chunks, 1), expected, atol=1e-4, rtol=0)


def test_a_cast_table_picked_by_row_and_columns_continues_from_the_store():
    model = _TableBlock().eval()
    ids = _ids(seed=9, length=30)
    with torch.no_grad():
        expected = model(ids)
    compiled = torch.compile(model, backend="kvtopo")
    REPORTS.clear()
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()):
        chunks = [compiled(ids[:, :11]), compiled(ids[:, 11:29]), compiled(ids[:, 29:])]
    assert REPORTS and all(r.positions == 1 for r in REPORTS), REPORTS
    torch.testing.assert_close(torch.cat(chunks, 1), expected, atol=1e-4, rtol=0)


class _SlicedPositionsBlock(torch.nn.Module):
    """Positions as the first T rows of a table the model holds (`how`): a rotary cache
    `cos_cached[:T]` (GPT-NeoX's older code), a learned `pos_emb[:, :T]` (minGPT), a sinusoidal
    buffer `pe[:T]`, or a sinusoid written in place into zeros from `arange(T)`; and a slice of a
    weight as long as the chunk by chance, `w[:T]` into a linear, which is no position."""

    def __init__(self, how: str, tokens: int = 12):
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.embed = torch.nn.Embedding(256, 32)
        self.qkv = torch.nn.Linear(32, 96)
        self.head = torch.nn.Linear(32, 256)
        angles = torch.arange(64).float()[:, None] * torch.logspace(0, -2, 4)[None]
        self.register_buffer("cos_cached", torch.cat([angles, angles], -1).cos())
        self.register_buffer("sin_cached", torch.cat([angles, angles], -1).sin())
        self.pos_emb = torch.nn.Parameter(torch.randn(1, 64, 32))
        self.register_buffer("pe", torch.randn(64, 32))
        self.mix = torch.nn.Parameter(torch.randn(tokens, 32) / 8)

    def forward(self, input_ids):
        t = input_ids.shape[1]
        x = self.embed(input_ids)
        if self.how == "learned":
            x = x + self.pos_emb[:, :t]
        elif self.how == "buffer":
            x = x + self.pe[:t]
        elif self.how == "in place":
            pe = torch.zeros(t, 32)
            pe[:, 0::2] = torch.sin(torch.arange(t).float()[:, None] * torch.logspace(0, -3, 16)[None])
            x = x + pe
        elif self.how == "weight":
            x = x + torch.nn.functional.linear(x, self.mix[:t]).sum(-1, keepdim=True)
        q, k, v = (part.view(1, t, 4, 8).transpose(1, 2) for part in self.qkv(x).chunk(3, -1))
        if self.how == "rotary":
            cos, sin = self.cos_cached[:t], self.sin_cached[:t]
            q, k = (z * cos + torch.cat([-z[..., 4:], z[..., :4]], -1) * sin for z in (q, k))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(y.transpose(1, 2).reshape(1, t, 32))


@pytest.mark.parametrize("how", ["rotary", "learned", "buffer", "in place"])
def test_positions_sliced_from_a_table_or_written_in_place_continue_from_the_store(how):
    """Each restarted at 0 on every chunk before (silently wrong in a session)."""
    model = _SlicedPositionsBlock(how).eval()
    ids = _ids(seed=4, length=30)
    with torch.no_grad():
        expected = model(ids)
    compiled = torch.compile(model, backend="kvtopo", options={"inductor": False})
    REPORTS.clear()
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless(page_size=8)):
        chunks = [compiled(ids[:, :12]), compiled(ids[:, 12:13]), compiled(ids[:, 13:])]
    sliced = 2 if how == "rotary" else 1  # cos and sin
    assert REPORTS and all(r.positions == sliced for r in REPORTS), REPORTS
    torch.testing.assert_close(torch.cat(chunks, 1), expected, atol=1e-4, rtol=0)


def test_a_weight_sliced_to_the_chunks_length_is_not_taken_for_positions():
    model = _SlicedPositionsBlock("weight").eval()
    ids = _ids(seed=4, length=12)
    compiled = torch.compile(model, backend="kvtopo", options={"inductor": False})
    REPORTS.clear()
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids), model(ids), atol=1e-5, rtol=0)
    assert REPORTS and all(r.positions == 0 for r in REPORTS), REPORTS


def test_generate_after_calls_in_a_session_still_compresses():
    """A second shape makes Dynamo recompile with dynamic sizes, and the mask's graph then reads the
    embeddings' sizes: a size is not a value, so the mask is still proven (before, every site was
    refused and kvtopo.generate fell back to the model's own cache)."""
    model = zoo.build("llama")
    ids = _ids(seed=10, length=30)
    with torch.no_grad():
        expected = model.generate(ids[:, :20], max_new_tokens=5, do_sample=False)
    kvtopo.compile(model, inductor=False)
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()):
        model(input_ids=ids[:, :17])
    REPORTS.clear()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "nothing is compressed" fallback
        got = kvtopo.generate(model, ids[:, :20], max_new_tokens=5)
    assert torch.equal(got, expected)
    assert REPORTS and all(r.sites and not r.refusals for r in REPORTS), [r.format() for r in REPORTS]


def test_mrope_position_ids_are_checked_and_a_restart_over_a_stored_history_raises():
    """Qwen2-VL's text positions come as [3, B, T] (temporal, height, width: equal for text): continued
    ones are exact, a restart at 0 over the stored tokens raises (the 3-D input was not checked)."""
    import transformers

    text = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, initializer_range=0.25, max_position_embeddings=256, pad_token_id=0,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1000.0})
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, in_channels=3, patch_size=2,
                  spatial_merge_size=2, temporal_patch_size=2)
    config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=150, video_token_id=151,
                                        vision_start_token_id=152)
    config._attn_implementation = config.text_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(config).eval()
    ids = _ids(seed=4, length=32) % 149
    expected = _full_logits(model, ids)
    kvtopo.compile(model, inductor=False)
    mrope = lambda a, b: torch.arange(a, b)[None, None].expand(3, 1, -1)  # noqa: E731
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless(page_size=8)):
        chunks = [model(input_ids=ids[:, a:b], position_ids=mrope(a, b)).logits for a, b in ((0, 16), (16, 32))]
        with pytest.raises(RuntimeError, match="numbers its 16 token.s. from 0 while the session holds 32"):
            model(input_ids=ids[:, :16], position_ids=mrope(0, 16))
    torch.testing.assert_close(torch.cat(chunks, 1), expected, atol=1e-4, rtol=0)
