"""export/check.py measures a runtime's logit error as |runtime - session|, in both directions.

`kvtopo export --target` and the export tests hold a runtime to the session by that error: a
runtime whose logits come out *below* the session's (a dropped bias or value mean, a scale
applied twice) is as wrong as one whose logits come out above. Measured as a signed difference,
such a runtime would show no error at all wherever its greedy tokens still agree, and the smoke
run would pass it."""

import numpy as np
import pytest

from kvtopo.export.check import agreement


class _Runner:
    layers = ()

    def nbytes(self):
        return 100


@pytest.mark.parametrize("offset", [-0.5, 0.5])
def test_logit_error_counts_logits_below_the_session_as_well_as_above(offset):
    session = np.zeros((3, 5), dtype=np.float32)
    session[:, 1] = 2.0
    runtime = session.copy()
    runtime[1, 3] += offset  # one logit off, the argmax (token 1) unchanged
    tokens = [7, 1, 1, 1]
    result = agreement("rt", _Runner(), tokens, runtime, (tokens, session, 100))
    assert result.same_tokens
    assert result.max_logit_error == pytest.approx(0.5, rel=1e-6)
    assert not result.passes(0.1) and result.passes(1.0)
    assert "LOGITS OFF by 5.0e-01" in result.describe(0.1)


def test_a_runtime_below_the_session_everywhere_is_not_excused_at_a_parting():
    """Every logit 0.3 below the session's, then a parting where the session's top two are 1.0
    apart: the error seen before the parting is 0.3, so a gap of 1.0 is no near-tie."""
    session = np.zeros((3, 5), dtype=np.float32)
    session[:, 1] = 2.0
    session[1, 2] = 1.0
    runtime = session - 0.3
    runtime[1, 2] = 2.5  # ranked first by the runtime at new token 1
    result = agreement("rt", _Runner(), [7, 1, 2, 1], runtime, ([7, 1, 1, 1], session, 100))
    assert result.parted_at == 1
    assert result.error_before_parting == pytest.approx(0.3, rel=1e-6)
    assert not result.parted_at_a_tie and "TOKENS DIFFER" in result.describe()


def test_a_logit_error_at_the_bound_passes():
    """--max-logit-error is the largest difference the smoke run accepts: an error equal to it passes."""
    session = np.zeros((2, 4), dtype=np.float32)
    session[:, 1] = 2.0
    runtime = session.copy()
    runtime[0, 2] = 0.5
    tokens = [3, 1, 1]
    result = agreement("rt", _Runner(), tokens, runtime, (tokens, session, 100))
    assert result.max_logit_error == 0.5
    assert result.passes(0.5) and not result.passes(0.49)
    assert "LOGITS OFF" not in result.describe(0.5)
