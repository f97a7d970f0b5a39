"""The export entry points and `kvtopo export` refuse sizes that cannot describe a cache, before
any tracing or model loading: a max_context (or a token count) that is not an int >= 1, a decode
step taking more new tokens than the cache holds, and a smoke run whose prompt and new tokens do
not fit in --max-context. Accepted, a max_context of 0 would size empty buffers and fail deep
inside the exporter (or, through the CLI, silently export the default 4096: `--max-context 0`
reads as "not given"), and a smoke run past max_context would stop in the host runner instead of
being named as a usage error."""

import pytest

from kvtopo.cli import main

from export_common import export_module, export_package


@pytest.mark.parametrize("function", ["export_onnx", "export_mlir", "export_iree"])
@pytest.mark.parametrize("max_context", [0, -1, True, 2.0])
def test_max_context_must_be_a_positive_int(function, max_context, tmp_path, monkeypatch):
    export = export_package()
    monkeypatch.setattr(export, "_model", lambda model: pytest.fail("built the model"))
    with pytest.raises(ValueError, match=rf"max_context={max_context!r} is invalid: an int >= 1"):
        getattr(export, function)("llama", tmp_path, max_context=max_context)


@pytest.mark.parametrize("tokens", [0, -2])
def test_mlir_token_count_must_be_a_positive_int(tokens, tmp_path, monkeypatch):
    export = export_package()
    monkeypatch.setattr(export, "_model", lambda model: pytest.fail("built the model"))
    with pytest.raises(ValueError, match=rf"tokens={tokens} is invalid: an int >= 1"):
        export.export_mlir("llama", tmp_path, max_context=16, tokens=tokens)


def test_mlir_decode_step_takes_at_most_max_context_tokens(tmp_path, monkeypatch):
    """A step's new tokens must fit in the cache: max_context tokens is the most (accepted), one
    more is refused before anything is traced."""
    export = export_package()
    calls = []
    monkeypatch.setattr(export_module("mlir_export"), "export_mlir_files",
                        lambda model, out, config, max_context, types, tokens, profile: calls.append(
                            (max_context, tokens)) or {})
    export.export_mlir("llama", tmp_path, max_context=16, tokens=16)
    assert calls == [(16, 16)]
    for tokens in (17, 32):
        with pytest.raises(ValueError, match=rf"tokens={tokens} is invalid: at most max_context=16"):
            export.export_mlir("llama", tmp_path, max_context=16, tokens=tokens)
    assert calls == [(16, 16)]


def _usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-5"])
def test_cli_max_context_below_one_is_a_usage_error(value, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("kvtopo.export_cli.load_model", lambda spec: pytest.fail("loaded the model"))
    err = _usage_error(["export", "onnx", "llama", "--out", str(tmp_path / "out"), "--max-context", value], capsys)
    assert f"--max-context {value} is invalid" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, message", [
    (["--smoke-prompt", "64"], "--smoke-prompt 64 is invalid: 1 .. max context 64 - 1"),
    (["--smoke-prompt", "0"], "--smoke-prompt 0 is invalid"),
    (["--smoke-prompt", "60", "--smoke-tokens", "5"], "--smoke-tokens 5 is invalid: 1 .. max context 64 - the 60-token prompt"),
    (["--smoke-prompt", "60", "--smoke-tokens", "0"], "--smoke-tokens 0 is invalid"),
], ids=["prompt-fills-the-context", "empty-prompt", "tokens-past-the-context", "no-tokens"])
def test_cli_smoke_run_must_fit_in_max_context(extra, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("kvtopo.export_cli.load_model", lambda spec: pytest.fail("loaded the model"))
    err = _usage_error(["export", "onnx", "llama", "--out", str(tmp_path / "out"), "--max-context", "64",
                        "--target", "onnxruntime", *extra], capsys)
    assert message in err, err
    assert not (tmp_path / "out").exists()
