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


# -- MODEL as a path or the real model's name ---------------------------------------------------
def _usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("files, model, message", [
    ({}, "absent", "no such file or directory"),
    ({}, ".", "a directory without config.json is not a Hugging Face checkpoint"),
    ({"config.json": b"{}"}, ".", "has config.json but no weights"),
    ({"model.gguf": b"PK\x03\x04 a zip"}, "model.gguf", "starts with b'PK\\x03\\x04'"),
    ({"weights.bin": b"GGUF"}, "weights.bin", "a file must be a GGUF model"),
], ids=["missing", "no-config", "no-weights", "not-gguf-content", "not-gguf-name"])
def test_model_path_that_is_neither_checkpoint_nor_gguf_is_named(tmp_path, capsys, files, model, message):
    src = tmp_path / "src"
    src.mkdir()
    for name, data in files.items():
        (src / name).write_bytes(data)
    path = src / model
    out = tmp_path / "out"
    err = _usage_error(["export", "onnx", str(path), "--out", str(out)], capsys)
    assert f"model path {path}: " in err and message in err, err
    assert not out.exists()


def test_unknown_model_name_lists_the_choices(tmp_path, capsys):
    err = _usage_error(["export", "onnx", "gpt5", "--out", str(tmp_path)], capsys)
    assert "unknown model 'gpt5'" in err and "llama" in err and "smollm2" in err, err


def test_checkpoint_directory_exports_and_runs(tmp_path, capsys):
    """A Hugging Face checkpoint directory (save_pretrained of the zoo Llama) loads, exports and
    gives the PyTorch session's tokens; the reference is the model loaded from the directory."""
    from kvtopo.models import zoo

    checkpoint = tmp_path / "checkpoint"
    zoo.build("llama").save_pretrained(checkpoint)
    code = main(["export", "onnx", str(checkpoint), "--out", str(tmp_path / "out"), "--max-context", "64",
                 "--target", "onnxruntime", "--smoke-tokens", "4"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "onnxruntime: same tokens as the PyTorch session over 4 new tokens" in out
