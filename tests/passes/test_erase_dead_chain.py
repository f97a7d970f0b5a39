"""What a rewrite erases once a site's output is replaced: the nodes only the old attention used,
never an in-place op, whose effect outlives its unused result, nor a graph input.

A Dynamo graph keeps in-place calls (DeepSeek-V3 fills its key tensor with `copy_`); one that
reaches the dead chain, here a buffer scaled in place whose returned alias only the old attention
read, must still run, or a later reader of the buffer sees it unscaled.
"""

import operator

import torch
import torch.fx as fx

from kvtopo.passes.rewrite import _erase_dead_chain


def _graph_with_a_dead_chain():
    """out = x + 1 after x.mul_(2); the only reader of mul_'s result is `dead`, and `dead` is
    read by nothing: the shape a replaced attention leaves behind."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    scaled = graph.call_method("mul_", (x, 2.0))
    negated = graph.call_function(torch.neg, (scaled,))
    dead = graph.call_function(operator.mul, (negated, 3.0))
    graph.output(graph.call_function(operator.add, (x, 1.0)))
    return graph, dead


def test_the_dead_chain_goes_and_the_in_place_op_stays():
    graph, dead = _graph_with_a_dead_chain()
    _erase_dead_chain(graph, dead)
    left = [str(n.target) for n in graph.nodes if n.op in ("call_function", "call_method")]
    assert left == ["mul_", str(operator.add)]  # neg and mul erased; mul_ and the live add stay
    module = fx.GraphModule(torch.nn.Module(), graph)
    x = torch.arange(4.0)
    torch.testing.assert_close(module(x.clone()), torch.arange(4.0) * 2 + 1, rtol=0, atol=0)


def test_a_node_still_read_elsewhere_is_not_erased():
    graph = fx.Graph()
    x = graph.placeholder("x")
    shared = graph.call_function(torch.neg, (x,))
    dead = graph.call_function(operator.mul, (shared, 3.0))
    graph.output(graph.call_function(operator.add, (shared, 1.0)))
    _erase_dead_chain(graph, dead)
    assert [n.op for n in graph.nodes] == ["placeholder", "call_function", "call_function", "output"]
    module = fx.GraphModule(torch.nn.Module(), graph)
    torch.testing.assert_close(module(torch.ones(2)), torch.zeros(2), rtol=0, atol=0)
