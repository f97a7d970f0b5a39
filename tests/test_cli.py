"""The `kvtopo` command line: `python -m kvtopo inspect <zoo model>`."""

import subprocess
import sys

import pytest

from kvtopo import cli
from kvtopo.models import zoo


def _run(*args):
    return subprocess.run([sys.executable, "-m", "kvtopo", *args], capture_output=True, text=True, timeout=300)


def test_inspect_lists_every_layer_with_its_shape_facts():
    result = _run("inspect", "llama")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for layer in ("model.layers.0.self_attn", "model.layers.1.self_attn"):
        line = next((l for l in out.splitlines() if layer in l), None)
        assert line is not None, out
        assert "found" in line and "sdpa" in line
        assert "heads=4 kv_heads=2" in line and "head_dim=16" in line
    assert "2 site(s) rewritten, 0 refused" in out


def test_unknown_model_exits_2_and_lists_the_zoo():
    result = _run("inspect", "no-such-model")
    assert result.returncode == 2
    assert "unknown zoo model 'no-such-model'" in result.stderr
    for name in zoo.ZOO_MODELS:
        assert name in result.stderr
    assert result.stdout == ""


def test_inspect_in_process_with_eager_attention(capsys):
    assert cli.main(["inspect", "llama", "--attn", "eager", "--tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "attn=eager" in out and "traced on 4 token(s)" in out
    assert out.count("found   model.layers.") == 2 and "eager, heads=4 kv_heads=2" in out


@pytest.mark.parametrize("argv", [[], ["inspect"], ["inspect", "llama", "--tokens", "0"],
                                  ["inspect", "llama", "--attn", "flash"], ["serve", "/tmp", "--port", "70000"]])
def test_bad_command_lines_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert "usage: kvtopo" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["serve", "/nonexistent/checkpoint"], "is not a checkpoint directory"),
    (["serve", "/tmp", "--config", '{"bogus": 1}'], "--config: "),
    (["serve", "/tmp", "--config", '{"protected_spans": [1, 2]}'], "protected_spans"),
    (["serve", "/", "--config", '{}'], "is a directory without a config.json"),
])
def test_serve_refuses_what_it_cannot_load_before_starting(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
