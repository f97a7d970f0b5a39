"""Window forms the passes read, and masks whose window they cannot apply, beyond those in
test_unread_masks.py: each accepted form is read as the keys it keeps and honoured chunk by chunk
in a session; each refused one is refused at compile time, when a 3-token chunk cannot show it."""

import pytest
import torch
import torch.nn.functional as F

import kvtopo
from kvtopo.models.blocks import _Projections
from masked_attention import MaskedAttention


def _ones(q, kv):
    return torch.ones(q.shape[0], kv.shape[1], dtype=torch.bool)


READ = {  # window 4: a query's own key and the 3 before it
    "q - 4 < kv": lambda q, kv: (kv <= q) & (q - 4 < kv),
    "q - 3 <= kv": lambda q, kv: (kv <= q) & (q - 3 <= kv),
    "tril minus tril(-4)": lambda q, kv: _ones(q, kv).tril() & ~_ones(q, kv).tril(-4),
}

REFUSED = {  # what a short chunk cannot show
    "two windows, 4 and 6": ("several sliding windows", lambda q, kv: (kv <= q) & (kv > q - 4) & (kv > q - 6)),
    "window of 0": ("sliding window of 0 tokens", lambda q, kv: (kv <= q) & (q - kv < 0)),
    "one key ahead, q - kv >= -1": ("neither causal order", lambda q, kv: q - kv >= -1),
    "every key, kv * 0 <= q": ("neither causal order", lambda q, kv: kv * 0 <= q),
    "one key ahead, triu(2) of -inf": (
        "neither causal order", lambda q, kv: torch.full((q.shape[0], kv.shape[1]), float("-inf")).triu(2)),
}


class PrefixOfAnInput(_Projections):
    """Causal, plus the first 2 keys seen by every query, the token indices passed in: compared
    with 2, an input's values are no padding mask's 0/1."""

    def forward(self, x, idx):
        q, k, v = self.qkv(x)
        mask = (idx[None, :] <= idx[:, None]) | (idx[None, :] < 2)
        return self.out(F.scaled_dot_product_attention(q, self.repeat_kv(k), self.repeat_kv(v), attn_mask=mask))


@pytest.mark.parametrize("name", sorted(READ))
def test_a_window_form_is_read_and_honoured_over_the_history(name):
    """Read from a 3-token chunk (which shows no band), applied to decode steps far past it."""
    block = MaskedAttention(READ[name]).eval()
    x = torch.randn(1, 12, 32)
    report = kvtopo.inspect(block, x[:, :3])
    assert [s.window for s in report.sites] == [4] and not report.refusals
    with torch.no_grad():
        expected = block(x)
    compiled = torch.compile(block, backend="kvtopo", options={"inductor": False})
    with torch.no_grad(), kvtopo.session(kvtopo.Config.lossless(page_size=2)):
        got = torch.cat([compiled(x[:, a:b]) for a, b in ((0, 3), (3, 4), (4, 9), (9, 10), (10, 11), (11, 12))], 1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_mask_whose_window_the_session_cannot_apply_is_refused(name):
    reason, build = REFUSED[name]
    report = kvtopo.inspect(MaskedAttention(build).eval(), torch.randn(1, 3, 32))
    assert not report.sites and len(report.refusals) == 1 and reason in report.refusals[0].reason, report.refusals


def test_an_input_compared_with_a_constant_other_than_0_or_1_is_refused():
    report = kvtopo.inspect(PrefixOfAnInput().eval(), torch.randn(1, 3, 32), torch.arange(3))
    assert not report.sites and "neither causal order" in report.refusals[0].reason, report.refusals


class UnsqueezedOrder(_Projections):
    """`kv <= q` (or, facing the future, `kv >= q`), the indices given their axes by `unsqueeze`."""

    def __init__(self, future):
        super().__init__()
        self.future = future

    def forward(self, x):
        q, k, v = self.qkv(x)
        idx = torch.arange(x.shape[1], device=x.device)
        query, key = idx.unsqueeze(1), idx.unsqueeze(0)
        mask = key >= query if self.future else key <= query
        return self.out(F.scaled_dot_product_attention(q, self.repeat_kv(k), self.repeat_kv(v), attn_mask=mask))


def test_a_one_token_graph_reads_the_order_from_where_unsqueeze_puts_each_index():
    """With one token both operands are [1, 1]: only `unsqueeze(1)` (a query index) and
    `unsqueeze(0)` (a key index) tell causal order from a mask facing the future."""
    x = torch.randn(1, 1, 32)
    causal, future = (kvtopo.inspect(UnsqueezedOrder(f).eval(), x) for f in (False, True))
    assert len(causal.sites) == 1 and not causal.refusals
    assert not future.sites and "neither causal order" in future.refusals[0].reason
