"""`context.suspended()` (the model's own attention and cache, e.g. kvtopo.generate's fallback to
the model's own cache) puts the session back even when the block raises: a later call in the
session must not run without it."""

import pytest

import kvtopo
from kvtopo.runtime import context


def test_the_session_is_active_again_after_a_suspended_block_raises():
    with kvtopo.session(kvtopo.Config.lossless()) as s:
        with pytest.raises(RuntimeError, match="boom"):
            with context.suspended():
                assert context.active_session() is None
                raise RuntimeError("boom")
        assert context.active_session() is s
    assert context.active_session() is None
