"""export/check.py's verdict, and the exit status `kvtopo export --target` derives from it.

A runtime's greedy run that parts from the session's is excused as a near-tie only when the
session's two candidates there lie within twice the float error the runtime showed before; the
export tests and the CLI's smoke run pass on that verdict, so a looser bound would let a runtime
that really computes something else pass. (tests/export/test_export_api.py checks a gap far
from the bound, 0.5 against 1e-4; these sit either side of it.)"""

import numpy as np
import pytest

from kvtopo.export.check import agreement

ERROR = 1e-3  # the runtime's logit error on every new token before the parting one


class _Runner:
    layers = ()

    def nbytes(self):
        return 100


def _parting_run(gap: float):
    """(tokens, runtime logits, session reference): the runs agree on new token 0 with logits
    ERROR apart, and part at new token 1, where the session's runner-up is `gap` below its top."""
    session = np.zeros((3, 5), dtype=np.float32)
    session[:, 1] = 1.0
    session[1, 2] = 1.0 - gap
    runtime = session + ERROR
    runtime[1, 2] = session[1, 1] + 2 * ERROR  # ranked first by the runtime
    return [7, 1, 2, 1], runtime, ([7, 1, 1, 1], session, 100)


@pytest.mark.parametrize("factor,tied", [(0.5, True), (1.9, True), (2.5, False), (10.0, False), (100.0, False)])
def test_a_parting_is_a_near_tie_only_within_twice_the_error_before_it(factor, tied):
    tokens, runtime, reference = _parting_run(factor * ERROR)
    result = agreement("rt", _Runner(), tokens, runtime, reference)
    assert result.parted_at == 1
    assert result.error_before_parting == pytest.approx(ERROR, rel=1e-3)
    assert result.tie_gap == pytest.approx(factor * ERROR, rel=1e-3)
    assert result.parted_at_a_tie is tied
    assert ("TOKENS DIFFER" in result.describe()) is not tied


@pytest.mark.parametrize("factor,code", [(1.0, 0), (10.0, 1)])
def test_the_cli_smoke_run_fails_when_the_runtime_parts_off_a_near_tie(factor, code, monkeypatch, capsys):
    """`kvtopo export --target` exits 1 when the runtime's tokens differ from the session's other
    than at a near-tie, 0 at a near-tie (the verdict printed says which)."""
    import torch

    from kvtopo import export_cli
    from kvtopo.export import check

    tokens, runtime, reference = _parting_run(factor * ERROR)
    monkeypatch.setattr(check, "compare_with_session",
                        lambda *args: [agreement("onnxruntime", _Runner(), tokens, runtime, reference)])
    assert export_cli._smoke_run(None, "unused", "onnxruntime", torch.tensor([[7]]), 3, None,
                                 export_cli.MAX_LOGIT_ERROR) == code
    out = capsys.readouterr().out
    assert ("TOKENS DIFFER" in out) is bool(code) and ("near-tie" in out) is not bool(code)


@pytest.mark.parametrize("offset,bound,code", [(0.5, 0.1, 1), (0.05, 0.1, 0), (0.5, 1.0, 0)])
def test_the_cli_smoke_run_fails_when_the_logits_are_off_though_the_tokens_agree(offset, bound, code, monkeypatch,
                                                                                 capsys):
    """Same greedy tokens, logits `offset` from the session's on one row: exit 1 above the bound
    (the runtime computes something else where its argmax happens to agree), 0 within it."""
    import torch

    from kvtopo import export_cli
    from kvtopo.export import check

    session = np.zeros((3, 5), dtype=np.float32)
    session[:, 1] = 2.0
    runtime = session.copy()
    runtime[2, 3] += offset
    tokens = [7, 1, 1, 1]
    monkeypatch.setattr(check, "compare_with_session",
                        lambda *args: [agreement("onnxruntime", _Runner(), tokens, runtime, (tokens, session, 100))])
    assert export_cli._smoke_run(None, "unused", "onnxruntime", torch.tensor([[7]]), 3, None, bound) == code
    out = capsys.readouterr().out
    assert "same tokens" in out and ("LOGITS OFF by 5.0e-01" in out) is bool(code), out
