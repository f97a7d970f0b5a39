"""`kvtopo export --target`: the export is compiled for the runtime and smoke-run against the
PyTorch session; a target that does not run the format is a usage error."""

import pytest

from kvtopo.cli import main


def test_target_must_run_the_format(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "mlir", "llama", "--out", str(tmp_path), "--target", "openvino"])
    assert exit_info.value.code == 2
    assert "--target openvino runs onnx exports, not mlir" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before exporting anything


def test_openvino_target_smoke_runs(tmp_path, capsys):
    code = main(["export", "onnx", "llama", "--out", str(tmp_path), "--max-context", "64", "--target", "openvino",
                 "--smoke-tokens", "4"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "openvino: same tokens as the PyTorch session over 4 new tokens" in out
    assert (tmp_path / "decode_step.onnx").is_file() and (tmp_path / "compressor.onnx").is_file()
