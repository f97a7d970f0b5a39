"""Every kvtopo op that reads or writes a session's store is registered ORDERED with torch's
effect system -- the attention op, the MLA attention op and the two position ops -- and reports
no effect while a graph is being exported (the export decomposes them instead).

``test_op_effects.py`` shows what the effect buys for ``kvtopo::attention`` (an unused output is
not dropped, calls keep program order); an op left out of the registration would lose both
silently (DeepSeek's MLA layers would stop storing their latents when a compiled graph discards
an output). Checked on the registry the compiler reads.
"""

from __future__ import annotations

import pytest
import torch
from torch._library.effects import EffectType
from torch._library.simple_registry import singleton

import kvtopo.kernels.ops  # noqa: F401  (registers the ops and their effects)

SESSION_OPS = ("kvtopo::attention", "kvtopo::mla_attention", "kvtopo::positions", "kvtopo::given_positions")


@pytest.mark.parametrize("qualname", SESSION_OPS)
def test_session_ops_are_ordered(qualname):
    assert singleton.find(qualname).effect.effect == EffectType.ORDERED


@pytest.mark.parametrize("qualname", SESSION_OPS)
def test_no_effect_while_exporting(qualname, monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    assert singleton.find(qualname).effect.effect is None
