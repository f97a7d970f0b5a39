"""`kvtopo inspect --tokens N` traces the model on an N-token prompt of ids inside the model's
vocabulary (8 by default), and the printed count is that of the prompt traced."""

import pytest
import torch

import kvtopo
from kvtopo import cli


@pytest.mark.parametrize("args,tokens", [(["--tokens", "5"], 5), ([], 8)])
def test_inspect_traces_the_requested_number_of_tokens(args, tokens, monkeypatch, capsys):
    traced = []
    real = kvtopo.inspect

    def record(model, ids, **kwargs):
        traced.append((ids.clone(), model.config.vocab_size))
        return real(model, ids, **kwargs)

    monkeypatch.setattr(kvtopo, "inspect", record)
    assert cli.main(["inspect", "llama", *args]) == 0
    (ids, vocab), = traced
    assert ids.shape == (1, tokens) and ids.dtype == torch.long
    assert 0 <= int(ids.min()) and int(ids.max()) < vocab
    assert f"traced on {tokens} token(s)" in capsys.readouterr().out
