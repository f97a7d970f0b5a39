"""topk_by_rank and scatter_by_compare (what the exported decode step computes for expert
routers) equal torch.topk and torch.scatter, and the capture routes every router's topk through it."""

import pytest
import torch

from kvtopo.models import zoo

from export_common import CONFIG, export_module


@pytest.mark.parametrize("shape,k,dim,largest", [((64, 4), 2, -1, True), ((3, 8, 5), 3, 1, False),
                                                 ((7, 256), 8, -1, True), ((6, 3), 6, 0, True)])
def test_topk_by_rank_equals_torch_topk(shape, k, dim, largest):
    topk_by_rank = export_module("decode_step").topk_by_rank
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(k))
    values, indices = topk_by_rank(x, k, dim, largest)
    ref_values, ref_indices = torch.topk(x, k, dim, largest)
    assert torch.equal(values, ref_values) and torch.equal(indices, ref_indices)


def test_topk_by_rank_ties_go_to_lower_index():
    values, indices = export_module("decode_step").topk_by_rank(torch.tensor([[1.0, 3.0, 0.0, 3.0]]), 3)
    assert indices.tolist() == [[1, 3, 0]] and values.tolist() == [[3.0, 3.0, 1.0]]


@pytest.mark.parametrize("shape,index_shape,dim", [((1, 1), (1, 1), 1), ((3, 8), (3, 4), 1), ((2, 5, 3), (2, 2, 3), -2),
                                                   ((4, 6), (2, 3), 1)])  # last: narrower index, torch's scatter
def test_scatter_by_compare_equals_torch_scatter(shape, index_shape, dim):
    scatter_by_compare = export_module("decode_step").scatter_by_compare
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    index = torch.randint(0, shape[dim], index_shape, generator=torch.Generator().manual_seed(1))
    assert torch.equal(scatter_by_compare(x, dim, index, 7.0), x.scatter(dim, index, 7.0))
    inplace = x.clone()
    assert scatter_by_compare(inplace, dim, index, 7.0, inplace=True) is inplace
    assert torch.equal(inplace, x.scatter(dim, index, 7.0))


def test_decode_step_has_no_topk_left():
    decode_step = export_module("decode_step")
    model = zoo.build("qwen3-moe")
    captured = decode_step.capture(model)
    assert sum(n.target is torch.topk for n in captured.gm.graph.nodes) == 2  # one router per layer
    layout = decode_step.layout_for(model, captured, CONFIG, 64)
    step = decode_step.DecodeStep(captured, layout)
    targets = [n.target for n in step.gm.graph.nodes if n.op in ("call_function", "call_method")]
    assert "topk" not in targets and torch.topk not in targets
    assert targets.count(decode_step.topk_by_rank) == 2
