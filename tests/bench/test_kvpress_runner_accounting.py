"""bench/kvpress_runner.py's accounting without kvpress: its kept fraction (held entries less
KVzip's head-wise masked ones, over layers x kv-heads x tokens seen), the prefill's and the
answer's bases, the compression ratio a nominal r asks for, and the fidelity rows' KL direction
and per-position agreement. kvpress is replaced by stand-in press classes, the model by a tiny
one that keeps its own cache, so this runs in the project's environment in a second
(test_real_quality_tasks.py runs the real presses where `make kvpress-env` was run)."""

import contextlib
import importlib
import json
import sys
import types
from pathlib import Path

import pytest
import torch
from float64_kl import kl64  # noqa: E402

BENCH = Path(__file__).resolve().parents[2] / "bench"


class Press:
    """Keeps `1 - compression_ratio` of the prefilled tokens (the latest), as a press's hooks do."""

    def __init__(self, compression_ratio):
        self.compression_ratio = compression_ratio

    @contextlib.contextmanager
    def __call__(self, model):
        model.press = self
        yield
        model.press = None


class Model:
    """Two layers, two kv-heads; logits depend on the last token and on how many tokens layer 0
    holds, so a press changes them. Appends to the DynamicCache it is given; a press truncates
    the prefill's entries."""

    def __init__(self):
        self.config = types.SimpleNamespace(num_key_value_heads=2, name_or_path="")
        self.model = types.SimpleNamespace(layers=[types.SimpleNamespace(self_attn=types.SimpleNamespace())
                                                   for _ in range(2)])
        self.press = None

    def __call__(self, input_ids, past_key_values, use_cache, position_ids, logits_to_keep):
        n = input_ids.shape[1]
        for i in range(2):
            keys = torch.zeros(1, 2, n, 1)
            past_key_values.update(keys, keys, i)
        if self.press is not None:
            for layer in past_key_values.layers:
                keep = round(layer.keys.shape[-2] * (1 - self.press.compression_ratio))
                layer.keys, layer.values = layer.keys[..., -keep:, :], layer.values[..., -keep:, :]
        held = past_key_values.layers[0].keys.shape[-2]
        logits = torch.zeros(1, n, 6)
        logits[0, -1, int(input_ids[0, -1]) % 6] = 1.0
        logits[0, -1] += 0.1 * held * torch.arange(6.0).flip(0) % 1.7
        return types.SimpleNamespace(logits=logits)


@pytest.fixture
def K(monkeypatch):
    fake = types.ModuleType("kvpress")
    fake.__version__ = "stand-in"
    for name in ("SnapKVPress", "ExpectedAttentionPress", "KnormPress", "StreamingLLMPress", "TOVAPress",
                 "KeyDiffPress", "KVzipPress"):
        setattr(fake, name, Press)
    monkeypatch.setitem(sys.modules, "kvpress", fake)
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.delitem(sys.modules, "kvpress_runner", raising=False)
    yield importlib.import_module("kvpress_runner")
    sys.modules.pop("kvpress_runner", None)


def test_kept_fraction_subtracts_masked_entries_and_averages_over_layers_and_heads(K):
    """Layer 0 holds 30 tokens in both kv-heads; layer 1 holds 40 of which KVzip masks 5 (head,
    token) entries: (60 + 75) / (2 layers x 2 heads x 50 seen)."""
    model = Model()
    masked = torch.tensor([0] * 5), torch.tensor([0, 0, 1, 1, 1]), torch.tensor([1, 2, 3, 4, 5])
    model.model.layers[0].self_attn.masked_key_indices = None
    model.model.layers[1].self_attn.masked_key_indices = masked
    cache = types.SimpleNamespace(layers=[types.SimpleNamespace(keys=torch.zeros(1, 2, 30, 1)),
                                          types.SimpleNamespace(keys=torch.zeros(1, 2, 40, 1))])
    assert K.kept_fraction(model, cache, 50) == pytest.approx(135 / 200)


def test_a_nominal_ratio_asks_kvpress_to_remove_one_minus_its_inverse(K):
    assert K.make_press("full", 4.0) is None
    assert K.make_press("snapkv", 4.0).compression_ratio == pytest.approx(0.75)


def test_prefill_kept_is_over_the_prefill_and_kept_over_every_token_seen(K):
    """150 context tokens pressed to 1/4, 50 question tokens, 8 answer tokens of which 7 are fed
    (the last, cut by the limit, is not): prefill 38/150; at the answer's end (38 + 50 + 7) / 207."""
    from real_quality import converse

    forward, kept = K.PressForward(Model(), K.make_press("snapkv", 4.0)), []
    ids = list(range(200))
    answer = converse(forward, [[ids[:150], ids[150:]]], [8], [], on_answer=lambda _: kept.append(forward.kept()))
    assert len(answer[0]) == 8
    assert forward.prefill_kept == pytest.approx(38 / 150) and kept == [pytest.approx((38 + 50 + 7) / 207)]


def test_fidelity_rows_are_kl_full_to_pressed_and_per_position_agreement(K, monkeypatch, tmp_path):
    """The runner's main on one prose request: "full" is its own reference (KL 0); the pressed row's
    KL is KL(full || pressed) of the same forced rows, its agreement the share of positions whose
    greedy token is the forced one, and its kept the end-of-text share."""
    import kvtopo.models.pretrained as pretrained
    from real_quality import forced_logits

    monkeypatch.setattr(pretrained, "smollm2", lambda dtype: (Model(), None))
    prefix, forced = list(range(12)), [1, 0, 4, 4, 4]  # the stand-in model's greedy continuation
    request = dict(presses=["snapkv"], ratios=[2.0], dtype="float32", threads=torch.get_num_threads(), eos=[],
                   examples=[], fidelity=[dict(id="t", length=12, seed=0, prefix=prefix, forced=forced)])
    (tmp_path / "in.json").write_text(json.dumps(request))
    K.main([str(tmp_path / "in.json"), str(tmp_path / "out.json")])
    full, pressed = json.loads((tmp_path / "out.json").read_text())["fidelity"]
    ref = forced_logits(K.PressForward(Model(), None), prefix, forced)
    cmp = forced_logits(K.PressForward(Model(), K.make_press("snapkv", 2.0)), prefix, forced)
    kl = sum(kl64(r.tolist(), c.tolist()) for r, c in zip(ref, cmp)) / len(forced)
    agree = [int(row.argmax()) == t for row, t in zip(cmp, forced)]
    assert full["press"] == "full" and full["kl"] == 0.0 and full["kept"] == 1.0
    reverse = sum(kl64(c.tolist(), r.tolist()) for r, c in zip(ref, cmp)) / len(forced)
    assert kl > 0 and kl != pytest.approx(reverse, rel=0.01)
    assert pressed["kl"] == pytest.approx(kl, rel=1e-9)
    assert agree == [False, False, False, True, True]  # agreement after a divergence counts too
    assert pressed["agree"] == pytest.approx(0.4)
    assert pressed["kept"] == pytest.approx((6 + 4) / 16) and pressed["prefill_kept"] == pytest.approx(0.5)
