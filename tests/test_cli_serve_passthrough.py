"""`kvtopo serve` hands the server what the command line says: the --host and --dtype given,
and a blocking start (the command serves until interrupted rather than returning at once);
an empty --config is refused rather than read as the default config; and the check that
keeps a stopped server from hanging the process counts only non-daemon threads."""

import threading

import pytest

from kvtopo import cli
from kvtopo.serving import serve


@pytest.fixture
def started(monkeypatch):
    calls = []
    monkeypatch.setattr(serve, "start_server", lambda model, config, **kwargs: calls.append((model, config, kwargs)))
    return calls


def test_host_dtype_and_blocking_start_reach_the_server(started):
    assert cli.main(["serve", "ckpt", "--host", "0.0.0.0", "--port", "9001", "--dtype", "bfloat16"]) == 0
    (model, _, kwargs), = started
    assert model == "ckpt"
    assert kwargs == dict(host="0.0.0.0", port=9001, block=True, dtype="bfloat16")


def test_defaults_reach_the_server(started):
    assert cli.main(["serve", "ckpt"]) == 0
    assert started[0][2] == dict(host="127.0.0.1", port=8000, block=True, dtype="auto")


def test_an_empty_config_is_a_usage_error(started, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "ckpt", "--config", ""])
    assert exc.value.code == 2
    assert "kvtopo serve: error: --config: " in capsys.readouterr().err
    assert started == []


def test_threads_left_lists_live_non_daemon_threads_only():
    release = threading.Event()
    worker = threading.Thread(target=release.wait, daemon=False)
    helper = threading.Thread(target=release.wait, daemon=True)
    worker.start()
    helper.start()
    try:
        left = cli._threads_left()
        assert worker in left
        assert helper not in left and threading.main_thread() not in left
    finally:
        release.set()
        worker.join()
        helper.join()
    assert worker not in cli._threads_left()
