"""`kvtopo inspect --tokens N` traces the model on an N-token prompt of ids inside the model's
vocabulary, and the printed count is that of the prompt traced."""

import torch

import kvtopo
from kvtopo import cli


def test_inspect_traces_the_requested_number_of_tokens(monkeypatch, capsys):
    traced = []
    real = kvtopo.inspect

    def record(model, ids, **kwargs):
        traced.append((ids.clone(), model.config.vocab_size))
        return real(model, ids, **kwargs)

    monkeypatch.setattr(kvtopo, "inspect", record)
    assert cli.main(["inspect", "llama", "--tokens", "5"]) == 0
    (ids, vocab), = traced
    assert ids.shape == (1, 5) and ids.dtype == torch.long
    assert 0 <= int(ids.min()) and int(ids.max()) < vocab
    assert "traced on 5 token(s)" in capsys.readouterr().out


def test_inspect_traces_eight_tokens_by_default(monkeypatch, capsys):
    traced = []
    real = kvtopo.inspect

    def record(model, ids, **kwargs):
        traced.append(tuple(ids.shape))
        return real(model, ids, **kwargs)

    monkeypatch.setattr(kvtopo, "inspect", record)
    assert cli.main(["inspect", "llama"]) == 0
    assert traced == [(1, 8)]
    assert "traced on 8 token(s)" in capsys.readouterr().out
