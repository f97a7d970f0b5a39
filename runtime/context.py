"""Which session, if any, the kvtopo attention op is running under.

Like vLLM's forward context: the op finds its KV store here instead of taking cache tensors as
graph inputs, so compiled graphs are the same inside and outside a session.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .session import Session

_active: ContextVar["Session | None"] = ContextVar("kvtopo_active_session", default=None)


def active_session() -> "Session | None":
    return _active.get()


def require_active_session(what: str) -> "Session":
    session = _active.get()
    if session is None:
        raise RuntimeError(f"{what} needs an active kvtopo session: use `with kvtopo.session(config) as s:`")
    return session


def enter(session: "Session"):
    return _active.set(session)


def leave(token) -> None:
    _active.reset(token)


@contextmanager
def suspended():
    """Run without any active session (the model's own attention and cache, unchanged)."""
    token = _active.set(None)
    try:
        yield
    finally:
        _active.reset(token)
