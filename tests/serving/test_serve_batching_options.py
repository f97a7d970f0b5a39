"""`transformers serve`'s continuous-batching options reach kvtopo's engine: the server builds its
batching config from `cb_max_batch_tokens` (and the other `cb_*` options) and hands it to the
model's `init_continuous_batching`, which kvtopo replaces; a forward of kvtopo's engine then packs
no more tokens than the server was told, with kvtopo's own engine settings still forced on top."""

import threading

import pytest

from kvtopo.config import Config
from kvtopo.serving import continuous_batching

pytest.importorskip("fastapi", reason="kvtopo serve needs transformers' server extras: pip install -e '.[serve]'")

from kvtopo.serving.serve import start_server  # noqa: E402

from test_serve import _chat, _free_port, _prompts, checkpoint  # noqa: E402,F401  (checkpoint: a fixture)

MAX_BATCH_TOKENS = 24


def test_the_servers_batch_token_limit_bounds_kvtopos_forwards(checkpoint, monkeypatch):  # noqa: F811
    path, _, _ = checkpoint
    packed = []
    start_forward = continuous_batching.KvtopoPagedCache._start_forward

    def recording(cache):
        start_forward(cache)
        packed.append(sum(span.tokens for span in cache._spans))

    monkeypatch.setattr(continuous_batching.KvtopoPagedCache, "_start_forward", recording)
    server = start_server(str(path), Config.lossless(page_size=16), port=_free_port(), dtype="float32",
                          cb_max_batch_tokens=MAX_BATCH_TOKENS)
    try:
        answer = _chat(server, str(path), _prompts([100])[0], max_tokens=3)
        manager = next(m.model._cached_continuous_batching_manager
                       for m in server._serve._model_manager.loaded_models.values())
    finally:
        stopping = threading.Thread(target=server.stop)
        stopping.start()
        stopping.join()
    assert answer
    assert manager.continuous_batching_config.max_batch_tokens == MAX_BATCH_TOKENS
    assert not manager.continuous_batching_config.allow_block_sharing  # kvtopo's settings still forced
    # The ~100-token prompt was prefilled in chunks of at most the server's limit.
    assert packed and max(packed) <= MAX_BATCH_TOKENS and sum(n > 1 for n in packed) >= 100 // MAX_BATCH_TOKENS, packed
