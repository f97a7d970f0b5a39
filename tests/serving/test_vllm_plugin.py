"""kvtopo's vLLM plugin: importable and installed as an entry point without vLLM, a clear error
from `register` without vLLM, and, where vLLM is installed, a registered backend name that vLLM
resolves to kvtopo's class and that refuses to be selected with the reason."""

import importlib.metadata
import importlib.util

import pytest

from kvtopo.serving import vllm_plugin

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_entry_point_names_register():
    (entry,) = [e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "kvtopo"]
    assert entry.load() is vllm_plugin.register


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_register_without_vllm_says_how_to_install():
    with pytest.raises(ImportError, match="pip install vllm"):
        vllm_plugin.register()


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed here")
def test_register_makes_the_backend_selectable_and_refused():
    from vllm.config.attention import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from kvtopo.serving.vllm_backend import NOT_AVAILABLE, KvtopoAttentionBackend

    vllm_plugin.register()
    vllm_plugin.register()  # vLLM may load plugins again; the second call must not fail
    member = AttentionBackendEnum[vllm_plugin.BACKEND_NAME]
    assert member.get_class() is KvtopoAttentionBackend
    assert AttentionConfig(backend=vllm_plugin.BACKEND_NAME).backend is member
    assert KvtopoAttentionBackend.get_name() == vllm_plugin.BACKEND_NAME
    assert KvtopoAttentionBackend.validate_configuration(head_size=64) == [NOT_AVAILABLE]
    assert "docs/vllm.md" in NOT_AVAILABLE
