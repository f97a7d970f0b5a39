"""The class vLLM loads when `--attention-backend KVTOPO` is selected. Imports vLLM.

It refuses every configuration through `validate_configuration`, the check vLLM's CUDA platform
runs on an explicitly selected backend, so selecting it stops at engine start-up with the reason
instead of failing inside a forward pass. vLLM's CPU platform never consults a selected backend
(it always takes its own CPU attention), so there the name is accepted and has no effect.
docs/vllm.md lists which parts of vLLM v1 would have to change for kvtopo's store to run here.
"""

from __future__ import annotations

from vllm.v1.attention.backend import AttentionBackend

from kvtopo.serving.vllm_plugin import BACKEND_NAME

NOT_AVAILABLE = (
    "kvtopo's compressed KV store does not run inside vLLM yet: its pages hold a varying number of "
    "tokens and bytes after eviction and low-bit coding, while vLLM's KV cache manager hands out "
    "fixed-size blocks indexed by token position; docs/vllm.md lists the vLLM classes that would "
    "have to change"
)


class KvtopoAttentionBackend(AttentionBackend):
    """kvtopo's backend name in vLLM: selectable, and refused with the reason (see module doc)."""

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @classmethod
    def validate_configuration(cls, **config) -> list[str]:
        return [NOT_AVAILABLE]

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError(NOT_AVAILABLE)

    @staticmethod
    def get_builder_cls():
        raise NotImplementedError(NOT_AVAILABLE)
