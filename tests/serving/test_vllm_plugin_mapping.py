"""kvtopo's vLLM plugin against a stand-in of the two vLLM modules it touches, where vLLM itself is
not installed (tests/serving/test_vllm_plugin.py runs the real registry only where it is): the
name `register` adds, the class path it records resolves to kvtopo's backend, a second call (vLLM
loads plugins in every process, possibly more than once) goes through the existing member, and
the backend refuses every configuration with the reason.

The stand-in registry behaves as vLLM 0.33's `vllm/v1/attention/backends/registry.py` does for
these calls (docs/vllm.md): `register_backend("NAME", path)` adds a member and raises for a name
that exists, `register_backend(member, path)` overrides that member's path, and
`AttentionBackendEnum[name]` looks a member up."""

import importlib
import importlib.util
import sys
import types

import pytest

from kvtopo.serving import vllm_plugin

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                                reason="vLLM is installed: test_vllm_plugin.py runs its real registry")


class _EnumMeta(type):
    def __getitem__(cls, name):
        return cls.__members__[name]


class _Member:
    def __init__(self, name, path):
        self.name, self.path = name, path

    def get_class(self):
        module, _, attr = self.path.rpartition(".")
        return getattr(importlib.import_module(module), attr)


@pytest.fixture
def fake_vllm(monkeypatch):
    """Stand-ins for vllm.v1.attention.backends.registry and vllm.v1.attention.backend; each
    register_backend call is recorded as (what it was given, class path)."""
    calls = []

    class AttentionBackendEnum(metaclass=_EnumMeta):
        __members__ = {}

    def register_backend(backend, class_path):
        calls.append((backend if isinstance(backend, str) else ("member", backend.name), class_path))
        if isinstance(backend, str):
            if backend in AttentionBackendEnum.__members__:
                raise ValueError(f"attention backend {backend!r} is already registered")
            AttentionBackendEnum.__members__[backend] = _Member(backend, class_path)
        else:
            backend.path = class_path

    class AttentionBackend:
        pass

    registry = types.ModuleType("vllm.v1.attention.backends.registry")
    registry.AttentionBackendEnum, registry.register_backend = AttentionBackendEnum, register_backend
    backend = types.ModuleType("vllm.v1.attention.backend")
    backend.AttentionBackend = AttentionBackend
    for name in ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.backends.registry", registry)
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.backend", backend)
    sys.modules.pop("kvtopo.serving.vllm_backend", None)  # imported below against the stand-in
    yield AttentionBackendEnum, calls, AttentionBackend
    sys.modules.pop("kvtopo.serving.vllm_backend", None)


def test_register_adds_the_name_once_and_its_path_is_kvtopos_backend(fake_vllm):
    enum, calls, base = fake_vllm
    vllm_plugin.register()
    vllm_plugin.register()  # a second load of the plugins must go through the member, not fail
    assert calls == [("KVTOPO", vllm_plugin.BACKEND_CLASS), (("member", "KVTOPO"), vllm_plugin.BACKEND_CLASS)]
    cls = enum[vllm_plugin.BACKEND_NAME].get_class()  # what vLLM imports when the name is selected

    from kvtopo.serving.vllm_backend import NOT_AVAILABLE, KvtopoAttentionBackend

    assert cls is KvtopoAttentionBackend and issubclass(cls, base)
    assert cls.get_name() == vllm_plugin.BACKEND_NAME
    # vLLM's CUDA platform starts an engine only when this list is empty: the backend is refused.
    assert cls.validate_configuration(head_size=64, dtype="float16") == [NOT_AVAILABLE]
    assert "docs/vllm.md" in NOT_AVAILABLE
    for method in (cls.get_impl_cls, cls.get_builder_cls):
        with pytest.raises(NotImplementedError, match="does not run inside vLLM"):
            method()
