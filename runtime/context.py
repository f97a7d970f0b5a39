"""Which session, if any, the kvtopo attention ops are running under.

The ops look their store up through kernels/store_hook.py (kernels never import the runtime);
this module is the runtime's side of that hook: a session enters itself there.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

from kvtopo.kernels.store_hook import active_store, reset_active_store, set_active_store

if TYPE_CHECKING:
    from .session import Session


def active_session() -> "Session | None":
    return active_store()


def require_active_session(what: str) -> "Session":
    session = active_store()
    if session is None:
        raise RuntimeError(f"{what} needs an active kvtopo session: use `with kvtopo.session(config) as s:`")
    return session


def enter(session: "Session"):
    return set_active_store(session)


def leave(token) -> None:
    reset_active_store(token)


@contextmanager
def suspended():
    """Run without any active session (the model's own attention and cache, unchanged)."""
    token = set_active_store(None)
    try:
        yield
    finally:
        reset_active_store(token)
