"""Positions from another start or by a step, which the store cannot continue, are checked: a chunk
numbered below the stored length raises instead of attending wrongly."""

import pytest
import torch

import kvtopo
from kvtopo.backend import REPORTS
from tiny_lm import TinyLM


class LearnedPositions(TinyLM):
    """Learned position embeddings looked up, or sliced, by a count that does not start at 0 or
    steps by 2 (`how`)."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.pos = torch.nn.Embedding(128, 32)

    def forward(self, ids):
        t = ids.shape[1]
        x = self.embed(ids)
        if self.how == "arange(t) + 2":
            x = x + self.pos(torch.arange(t) + 2)
        elif self.how == "arange(2, t + 2)":
            x = x + self.pos(torch.arange(2, t + 2))
        elif self.how == "arange(0, 2t, 2)":
            x = x + self.pos(torch.arange(0, 2 * t, 2))
        elif self.how == "table[2:t + 2]":
            x = x + self.pos.weight[2:t + 2]
        else:
            x = x + self.pos.weight[:2 * t:2]
        return self.attend(x)


@pytest.mark.parametrize("how", ["arange(t) + 2", "arange(2, t + 2)", "arange(0, 2t, 2)", "table[2:t + 2]",
                                 "table[:2t:2]"])
def test_positions_the_store_cannot_continue_raise_on_the_next_chunk(how):
    model = LearnedPositions(how).eval()
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids)
    compiled = torch.compile(model, backend="kvtopo", options={"inductor": False})
    REPORTS.clear()
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids), expected, atol=1e-5, rtol=0)  # unchanged outside a session
        with kvtopo.session(kvtopo.Config.lossless()):
            torch.testing.assert_close(compiled(ids[:, :12]), expected[:, :12], atol=1e-5, rtol=0)
            with pytest.raises(RuntimeError, match="numbers its 1 token.*while the session holds 12.*pass position_ids"):
                compiled(ids[:, 12:13])
    assert all(r.positions == 0 for r in REPORTS) and any(r.given_positions for r in REPORTS)


@pytest.mark.parametrize("how", ["arange(t) + 2", "arange(2, t + 2)", "table[2:t + 2]"])
def test_a_first_chunk_shorter_than_the_offset_does_not_hide_a_restart(how):
    """One token stored, then a chunk numbered from 2 again: 2 is not below the stored length (1),
    but a continuation would start at 1 + 2, the start the count had over the empty store."""
    model = LearnedPositions(how).eval()
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids)
    compiled = torch.compile(model, backend="kvtopo", options={"inductor": False})
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()) as s:
        torch.testing.assert_close(compiled(ids[:, :1]), expected[:, :1], atol=1e-5, rtol=0)
        with pytest.raises(RuntimeError, match="numbers its 5 token.*from 2 while the session holds 1 "):
            compiled(ids[:, 1:6])
        s.clear()  # a new prompt over the cleared store starts from 2 again, as over a new session
        torch.testing.assert_close(compiled(ids[:, :4]), model(ids[:, :4]), atol=1e-5, rtol=0)
