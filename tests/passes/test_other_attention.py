"""Attention the passes do not rewrite is refused by name, so a session raises instead of silently
attending over the new chunk alone: softmax over `bmm` scores (XGLM), FlexAttention,
nn.MultiheadAttention."""

from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import transformers

import kvtopo
from kvtopo.backend import REPORTS, RefusedAttention
from kvtopo.models import zoo


@pytest.fixture(autouse=True)
def _fresh_reports():
    """Reports from earlier tests' compiles never count here (conftest resets Dynamo)."""
    REPORTS.clear()


def _xglm():
    config = transformers.XGLMConfig(num_layers=2, attention_heads=4, d_model=64, ffn_dim=128, vocab_size=256,
                                     max_position_embeddings=256, dropout=0.0, attention_dropout=0.0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.XGLMForCausalLM(config).eval()


def _flex_llama():
    model = zoo.build("llama", "eager")
    for module in model.modules():
        if hasattr(module, "config"):
            module.config._attn_implementation = "flex_attention"
    return model


class _MultiheadBlock(torch.nn.Module):
    def __init__(self, need_weights: bool):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(256, 32)
        self.attn = torch.nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = torch.nn.Linear(32, 256)
        self.need_weights = need_weights

    def forward(self, input_ids):
        x = self.embed(input_ids)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        y, _ = self.attn(x, x, x, attn_mask=causal, need_weights=self.need_weights)
        return self.head(y)


@dataclass(frozen=True)
class Case:
    build: Callable[[], torch.nn.Module]
    reason: str
    reference: Callable[[], torch.nn.Module] | None = None  # what the logits must equal (default: the model)
    inductor: bool = True


CASES = {
    "xglm-bmm": Case(_xglm, "scores come from bmm"),
    # torch's own flex_attention on CPU, eager and Inductor's kernel, gave wrong or NaN logits on an
    # AVX2-only machine (a Dynamo graph run eagerly was exact): kvtopo's part is checked without
    # Inductor, against the same weights with eager attention.
    "flex_attention": Case(_flex_llama, "flex_attention is an attention kvtopo does not rewrite",
                           reference=lambda: zoo.build("llama", "eager"), inductor=False),
    "multihead-weights": Case(lambda: _MultiheadBlock(True), "nn.MultiheadAttention is an attention"),
    "multihead-sdpa": Case(lambda: _MultiheadBlock(False), "nn.MultiheadAttention is an attention"),
}


def _logits(output):
    return output.logits if hasattr(output, "logits") else output


@pytest.mark.parametrize("case", list(CASES))
def test_refused_by_name_and_a_session_raises(case):
    spec = CASES[case]
    model = spec.build()
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = _logits((spec.reference() if spec.reference else model)(input_ids=ids))
    compiled = torch.compile(model, backend="kvtopo", options={"inductor": spec.inductor})
    with torch.no_grad():  # outside a session the graph runs unchanged
        got = _logits(compiled(input_ids=ids))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    refusals = [r for report in REPORTS for r in report.refusals]
    assert refusals and all(spec.reason in r.reason for r in refusals), refusals
    assert not any(report.sites for report in REPORTS)
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()) as s:
        with pytest.raises(RefusedAttention, match="refused"):
            compiled(input_ids=ids[:, :12])
        assert s.stats().tokens == ()


def test_generate_falls_back_to_the_models_own_cache():
    model = _xglm()
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=6, do_sample=False)
    kvtopo.compile(model, inductor=False)
    with pytest.warns(UserWarning, match="nothing is compressed|refused"):
        got = kvtopo.generate(model, ids, max_new_tokens=6)
    assert torch.equal(got[:, :expected.shape[1]], expected)
