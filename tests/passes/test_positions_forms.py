"""Counts from 0 that are not the chunk's positions from 0 stay as they are: a count of something
else, and one the caller moves by its own start, are not continued from the store again."""

import pytest
import torch

import kvtopo
from kvtopo.backend import REPORTS
from tiny_lm import TinyLM, rotary


class RotaryFrequenciesInForward(TinyLM):
    """RoPE whose inverse frequencies are computed in forward from `arange(head_dim // 2)`, and
    queries scaled per channel by a held table's first head_dim rows, `scale[:8]`: a zero-based
    count that reaches the cos/sin and a table slice met elementwise, as positions are, but no
    positions (neither is as long as the chunk)."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.rand(16) + 0.5)

    def forward(self, input_ids):
        inv_freq = 1.0 / (100.0 ** (torch.arange(4).float() / 4))
        angles = torch.arange(input_ids.shape[1]).float()[:, None] * inv_freq[None]
        return self.attend(self.embed(input_ids), *rotary(angles), query_scale=self.scale[:8])


CUTS = {
    # The 4-token chunk comes after a 7-token one: Dynamo compiles it with a symbolic length, which
    # no constant count equals.
    "of other lengths": ((0, 7), (7, 11), (11, 12), (12, 20)),
    # Equal chunks as long as `arange(4)`, which reaches the cos/sin only through a power, as no
    # position does, or as `scale[:8]`, cut along the channels, not a table's rows.
    "as long as the frequencies": tuple((a, a + 4) for a in range(0, 20, 4)),
    "as long as the scale": ((0, 8), (8, 16), (16, 20)),
}


@pytest.mark.parametrize("chunks", CUTS.values(), ids=CUTS.keys())
def test_a_count_or_slice_of_something_else_is_not_continued_from_the_store(chunks):
    """Only `arange(t)` is routed: shifting `arange(4)` by the store too would change the
    frequencies of every chunk after the first, and `scale[:8]` would take other rows."""
    model = RotaryFrequenciesInForward().eval()
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids)
    compiled = torch.compile(model, backend="kvtopo", options={"inductor": False})
    REPORTS.clear()
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()):
        got = torch.cat([compiled(ids[:, a:b]) for a, b in chunks], 1)
    assert REPORTS and all(r.positions == 1 and r.given_positions == 0 for r in REPORTS), REPORTS  # the token count only
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


class CallersOffsetOnACountReadTwice(TinyLM):
    """Rotary positions `arange(t) + offset`, the caller passing the stored length as `offset`, the
    count also read a second time (here to build an all-ones gate)."""

    def forward(self, input_ids, offset=0):
        count = torch.arange(input_ids.shape[1])
        gate = (count >= 0).float()[None, :, None]
        angles = (count + offset).float()[:, None] * torch.logspace(0, -2, 4)
        return self.attend(self.embed(input_ids) * gate, *rotary(angles))


def test_a_start_the_caller_adds_to_a_count_read_twice_is_not_added_again():
    """The count's other reader does not make it the chunk's positions from 0: the caller's
    start is among its users, so the session's stored length must not be added on top."""
    model = CallersOffsetOnACountReadTwice().eval()
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids)
    compiled = torch.compile(model, backend="kvtopo", options={"inductor": False})
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()):
        chunks = [compiled(ids[:, a:b], offset=a) for a, b in ((0, 11), (11, 29), (29, 30))]
    torch.testing.assert_close(torch.cat(chunks, 1), expected, atol=1e-4, rtol=0)


class RotaryOfGivenPositions(TinyLM):
    """Positions passed in as `pos`, rotated by cos/sin computed from them: in the attention's
    graph, or (`split`) before a graph break, so that the attention's graph takes inputs named
    `cos` and `sin`."""

    def __init__(self, split):
        super().__init__()
        self.split = split

    def forward(self, input_ids, pos):
        cos, sin = rotary(pos.float()[:, None] * torch.logspace(0, -2, 4))
        if self.split:
            torch._dynamo.graph_break()
        return self.attend(self.embed(input_ids), cos, sin)


@pytest.mark.parametrize("split", [False, True])
def test_positions_passed_as_pos_or_as_rotary_cos_and_sin_are_checked(split):
    """Continued positions are exact; restarting at 0 over the stored tokens raises rather than
    rotating the new chunk as if it came first."""
    model = RotaryOfGivenPositions(split).eval()
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(ids, torch.arange(30))
    compiled = torch.compile(model, backend="kvtopo", options={"inductor": False})
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless()):
        chunks = [compiled(ids[:, a:b], torch.arange(a, b)) for a, b in ((0, 11), (11, 29), (29, 30))]
        with pytest.raises(RuntimeError, match="from 0 while the session holds 30"):
            compiled(ids[:, :5], torch.arange(5))
    torch.testing.assert_close(torch.cat(chunks, 1), expected, atol=1e-4, rtol=0)
