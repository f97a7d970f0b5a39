"""`kvtopo.compile(model, dynamic=...)` hands `dynamic` on to Dynamo.

`dynamic=False` asks for one graph per input shape (each compiled and reported by the kvtopo
backend), `dynamic=True` for one graph over symbolic lengths; dropping the argument would give
Dynamo's default (static first, then automatically dynamic), and the user's choice would be
silently ignored. Counted through the reports the backend keeps for every graph it compiles,
outputs checked against the uncompiled block.
"""

import pytest
import torch

import kvtopo
import kvtopo.backend
from kvtopo.models.blocks import SDPACausal

HIDDEN = 32
LENGTHS = (3, 5, 7)


@pytest.mark.parametrize("dynamic,graphs", [(False, len(LENGTHS)), (True, 1)])
def test_dynamic_decides_how_many_graphs_are_compiled(dynamic, graphs):
    torch._dynamo.reset()
    reference = SDPACausal(seed=0).eval()
    model = kvtopo.compile(SDPACausal(seed=0).eval(), inductor=False, dynamic=dynamic)
    before = len(kvtopo.backend.REPORTS)
    with torch.no_grad():
        for t in LENGTHS:
            x = torch.randn(1, t, HIDDEN, generator=torch.Generator().manual_seed(t))
            torch.testing.assert_close(model(x), reference(x), atol=1e-5, rtol=0)
    new = kvtopo.backend.REPORTS[before:]
    assert len(new) == graphs, [r.format() for r in new]
    assert all(len(r.sites) == 1 and not r.refusals for r in new)
    torch._dynamo.reset()
