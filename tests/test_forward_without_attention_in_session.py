"""A `kvtopo.compile`d model whose forward, called directly inside a session, runs no kvtopo
attention raises instead of returning an output computed without the session's history.

Here the model has no attention the passes rewrite (a plain MLP over token embeddings): outside a
session it must still equal the uncompiled model, inside one the forward must raise and name the
model, since its tokens would only have seen themselves. (`kvtopo.generate` checks this too; a
user calling the model by hand inside `kvtopo.session` relies on this check alone.)
"""

import pytest
import torch
import torch.nn as nn

import kvtopo


class NoAttention(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _compiled(how: str) -> nn.Module:
    model = NoAttention().eval()
    if how == "kvtopo.compile":
        return kvtopo.compile(model, inductor=False)
    model.compile(backend="kvtopo", options={"inductor": False})
    return model


@pytest.mark.parametrize("how", ["kvtopo.compile", "Module.compile"])
def test_a_direct_forward_without_kvtopo_attention_raises_inside_a_session(how):
    """`Module.compile(backend="kvtopo")` never goes through `kvtopo.compile`; the backend puts the
    same check on the module's compiled call from its first forward on."""
    torch._dynamo.reset()
    reference, model = NoAttention().eval(), _compiled(how)
    x = torch.randn(1, 4, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x))  # outside a session: the model as it was
        with kvtopo.session(kvtopo.Config.lossless()):
            with pytest.raises(RuntimeError, match="forward of NoAttention inside a session ran no kvtopo attention"):
                model(x)
    torch._dynamo.reset()



class Wrapper(nn.Module):
    """All its parameters sit in one child, which its forward is also handed as an argument (as a
    decorator's wrapper is handed modules): the two hold the same parameters, and the backend must
    still take the wrapper, the module compiled in place and the first of its frame's locals."""

    def __init__(self):
        super().__init__()
        self.inner = NoAttention()

    def forward(self, x, layer):
        return layer(x)


def test_the_check_lands_on_the_compiled_wrapper_when_an_argument_holds_every_parameter():
    torch._dynamo.reset()
    reference, model = Wrapper().eval(), Wrapper().eval()
    reference.load_state_dict(model.state_dict())
    model.compile(backend="kvtopo", options={"inductor": False})
    x = torch.randn(1, 4, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(x, model.inner), reference(x, reference.inner))
        with kvtopo.session(kvtopo.Config.lossless()):
            with pytest.raises(RuntimeError, match="forward of Wrapper inside a session ran no kvtopo attention"):
                model(x, model.inner)
    torch._dynamo.reset()
