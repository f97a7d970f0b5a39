"""`kvtopo serve` argument handling without starting a server: `start_server` is replaced by a
recorder, so what the command line hands it (the parsed --config, host, port) and the exit status
of each way it can end are checked directly."""

import json

import pytest

import kvtopo
from kvtopo import cli
from kvtopo.serving import serve


@pytest.fixture
def started(monkeypatch):
    calls = []

    def record(model, config, **kwargs):
        calls.append((model, config, kwargs))

    monkeypatch.setattr(serve, "start_server", record)
    return calls


def test_config_from_a_json_file(tmp_path, started):
    path = tmp_path / "kv.json"
    path.write_text(json.dumps({"target_ratio": 8, "protected_spans": [[0, 16], [32, 48]]}))
    assert cli.main(["serve", "ckpt", "--config", str(path)]) == 0
    (model, config, kwargs), = started
    assert model == "ckpt"
    assert config == kvtopo.Config(target_ratio=8, protected_spans=((0, 16), (32, 48)))
    assert kwargs["port"] == 8000 and kwargs["host"] == "127.0.0.1"


def test_inline_config_with_leading_whitespace_and_spans(started):
    assert cli.main(["serve", "ckpt", "--config", '  {"target_ratio": 4, "protected_spans": [[0, 8]]}']) == 0
    assert started[0][1] == kvtopo.Config(target_ratio=4, protected_spans=((0, 8),))


def test_no_config_is_the_default_config(started):
    assert cli.main(["serve", "ckpt"]) == 0
    assert started[0][1] == kvtopo.Config()


@pytest.mark.parametrize("argv, message", [
    (["--config", "/nonexistent/kv.json"], "--config: "),  # OSError
    (["--config", "{not json"], "--config: "),
    (["--config", '"a string"'], "--config: "),
    (["--config", '{"target_ratio": -1}'], "target_ratio"),  # Config's ValueError
])
def test_bad_config_exits_2_without_starting(argv, message, started, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "ckpt", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "kvtopo serve: error: " in err and message in err and "Traceback" not in err
    assert started == []


@pytest.mark.parametrize("port, ok", [("1", True), ("65535", True), ("65536", False), ("0", False)])
def test_port_range_is_1_to_65535(port, ok, started, capsys):
    if ok:
        assert cli.main(["serve", "ckpt", "--port", port]) == 0
        assert started[0][2]["port"] == int(port)
    else:
        with pytest.raises(SystemExit) as exc:
            cli.main(["serve", "ckpt", "--port", port])
        assert exc.value.code == 2 and started == []


@pytest.mark.parametrize("raised, code, message", [
    (serve.ServerStartError("could not listen at http://127.0.0.1:8000"), 1, "kvtopo serve: error: could not listen"),
    (KeyboardInterrupt(), 130, "kvtopo serve: stopped"),
])
def test_serve_exit_status(monkeypatch, capsys, raised, code, message):
    def fail(*args, **kwargs):
        raise raised

    monkeypatch.setattr(serve, "start_server", fail)
    assert cli.main(["serve", "ckpt"]) == code
    assert message in capsys.readouterr().err


def test_a_missing_model_is_a_usage_error(monkeypatch, capsys):
    def missing(*args, **kwargs):
        raise FileNotFoundError("model 'ckpt' is not a checkpoint directory")

    monkeypatch.setattr(serve, "start_server", missing)
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "ckpt"])
    assert exc.value.code == 2
    assert "kvtopo serve: error: model 'ckpt' is not a checkpoint directory" in capsys.readouterr().err
