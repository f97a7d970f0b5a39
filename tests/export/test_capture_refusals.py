"""Export refuses, with its reason and before writing anything, a model it would capture only in
part: a forward Dynamo splits into several graphs (a graph break), of which the exported decode
step would hold the first alone, and a model with no attention site, whose decode step would
have no cache to carry. Taken as they come, the first would export the graph up to the break
(here: the attention's output, the same shape as the logits) as if it were the whole model."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from export_common import CONFIG, export_package


class _Tiny(nn.Module):
    """Embedding, one causal SDPA attention (2 heads of 16), a head over 32 ids; optionally a
    graph break after the attention, or no attention at all."""

    def __init__(self, graph_break=False, attention=True):
        super().__init__()
        self.config = type("TinyConfig", (), {"vocab_size": 32})()
        self.embed = nn.Embedding(32, 32)
        self.qkv = nn.Linear(32, 96)
        self.head = nn.Linear(32, 32)
        self.graph_break, self.attention = graph_break, attention

    def forward(self, input_ids, position_ids=None, use_cache=False):
        x = self.embed(input_ids)
        if self.attention:
            q, k, v = self.qkv(x).view(1, -1, 3, 2, 16).permute(2, 0, 3, 1, 4)
            x = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(1, -1, 32)
        if self.graph_break:
            torch._dynamo.graph_break()
        return (self.head(x),)


@pytest.mark.parametrize("model, message", [
    (lambda: _Tiny(graph_break=True), r"Dynamo split the model into 2 graphs \(graph breaks\); export needs one graph"),
    (lambda: _Tiny(attention=False), "kvtopo found no attention site in the model"),
], ids=["graph-break", "no-attention"])
def test_a_model_captured_in_part_is_refused(model, message, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=message):
        export_package().export_onnx(model().eval(), out, config=CONFIG, max_context=64)
    assert not out.exists()


def test_the_same_model_in_one_graph_is_captured_with_its_site():
    """The refusals are about the break and the missing site: the model without them is captured."""
    from kvtopo.export.decode_step import capture

    captured = capture(_Tiny().eval())
    assert len(captured.sites) == 1
