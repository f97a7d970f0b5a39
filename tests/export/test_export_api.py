"""The export entry points' handling of what the caller passes: an output directory nothing can
be written to is refused before any tracing; the caller's model comes back in its own modes."""

import numpy as np
import pytest

from kvtopo.models import zoo

from export_common import export_module, export_package


@pytest.mark.parametrize("function", ["export_onnx", "export_mlir", "export_iree"])
def test_unwritable_out_dir_is_refused_before_tracing(function, monkeypatch):
    """Linux's /proc: no file can be created in it, even by root."""
    export = export_package()
    monkeypatch.setattr(export, "_model", lambda model: pytest.fail("built the model"))
    with pytest.raises(ValueError, match=r"out_dir='/proc/kvtopo' is invalid: /proc is not writable"):
        getattr(export, function)("llama", "/proc/kvtopo")


@pytest.mark.parametrize("function, module, files", [("export_onnx", "onnx_export", "export_onnx_files"),
                                                     ("export_mlir", "mlir_export", "export_mlir_files")])
def test_export_traces_in_eval_mode_and_restores_the_callers_modes(function, module, files, tmp_path, monkeypatch):
    """Dropout must not reach the graphs, and the caller's model (here training, one layer in eval
    mode) keeps every module's mode."""
    model = zoo.build("llama").train()
    model.model.layers[0].eval()
    modes = [m.training for m in model.modules()]
    seen = []
    monkeypatch.setattr(export_module(module), files,
                        lambda exported, *args: seen.append([m.training for m in exported.modules()]) or {})
    getattr(export_package(), function)(model, tmp_path)
    assert seen == [[False] * len(modes)]
    assert [m.training for m in model.modules()] == modes


class _Runner:
    def nbytes(self):
        return 100


@pytest.mark.parametrize("gap,tied", [(1e-4, True), (0.5, False)])
def test_runs_that_part_are_judged_by_the_sessions_gap_where_they_part(gap, tied):
    """A runtime's greedy run that parts from the session's where the session's top two logits
    lie within twice the float error seen before parted at a near-tie (summation order decides
    it); parted anywhere else, the tokens differ. The error is taken up to the parting step,
    since the runs continue different texts after it."""
    from kvtopo.export.check import agreement

    session_logits = np.zeros((3, 5), dtype=np.float32)
    session_logits[:, 1] = 1.0
    session_logits[1, 2] = 1.0 - gap  # at new token 1 the session's runner-up is token 2
    runtime_logits = session_logits + 1e-4
    runtime_logits[1, 2] += gap  # the runtime's own rounding ranks token 2 first there
    runtime_logits[2] = 50.0  # after parting: another text, not compared
    reference = ([7, 1, 1, 1], session_logits, 100)
    result = agreement("rt", _Runner(), [7, 1, 2, 4], runtime_logits, reference)
    assert result.parted_at == 1 and result.tie_gap == pytest.approx(gap, rel=1e-3)
    assert result.max_logit_error == pytest.approx(max(1e-4, gap + 1e-4), rel=1e-3)
    assert not result.same_tokens and result.parted_at_a_tie is tied
    assert ("near-tie" in result.describe()) is tied and ("TOKENS DIFFER" in result.describe()) is not tied
    same = agreement("rt", _Runner(), [7, 1, 1, 1], session_logits + 1e-4, reference)
    assert same.same_tokens and same.parted_at is None and not same.parted_at_a_tie


def test_a_run_that_parts_at_the_first_new_token_is_never_excused_as_a_near_tie():
    """There the only error to judge by is the parting step's own, which covers any gap: a
    runtime computing something else entirely (its top token 50 logits up, the session's 10)
    would pass as a near-tie, and `kvtopo export --target` would exit 0 on it."""
    from kvtopo.export.check import agreement

    session_logits = np.zeros((4, 8), dtype=np.float32)
    session_logits[:, 1] = 10.0
    runtime_logits = np.zeros((4, 8), dtype=np.float32)
    runtime_logits[:, 5] = 50.0
    result = agreement("rt", _Runner(), [0, 5, 5, 5, 5], runtime_logits, ([0, 1, 1, 1, 1], session_logits, 100))
    assert result.parted_at == 0 and result.error_before_parting is None
    assert not result.parted_at_a_tie and "TOKENS DIFFER" in result.describe()
