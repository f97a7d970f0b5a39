"""The export entry points' handling of what the caller passes: an output directory nothing can
be written to is refused before any tracing; the caller's model comes back in its own modes."""

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
