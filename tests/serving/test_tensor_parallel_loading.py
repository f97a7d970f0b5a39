"""load_tensor_parallel without starting ranks: transformers' loader is replaced by a recorder,
so what it is asked for (tp_plan "auto" over the world size, float32 unless told, any other
from_pretrained arguments) and what is done to the model it returns (eval mode, compiled with
the kvtopo backend and the inductor option given) are checked directly. Also: the world size
comes from WORLD_SIZE when tp_size is not given, a missing WORLD_SIZE says to use torchrun, a
bool is not a rank count, a config without num_key_value_heads counts its query heads as
kv-heads, and stored_kv_heads reports the kv-head count of every layer store that has pages."""

import types

import pytest
import torch

from kvtopo.serving.tensor_parallel import load_tensor_parallel, stored_kv_heads


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.compiled_with = None

    def compile(self, **kwargs):
        self.compiled_with = kwargs


@pytest.fixture
def loads(monkeypatch):
    from transformers import AutoModelForCausalLM

    calls = []

    def load(path, **kwargs):
        model = _Model()  # a freshly built module is in training mode
        calls.append((path, kwargs, model))
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", load)
    return calls


@pytest.fixture
def llama_dir(tmp_path):
    from kvtopo.models import zoo

    zoo.build("llama").config.save_pretrained(tmp_path)  # 4 query heads, 2 kv-heads
    return tmp_path


def test_the_loader_gets_the_auto_plan_float32_and_extra_arguments(loads, llama_dir):
    model = load_tensor_parallel(llama_dir, tp_size=2, inductor=False, revision="abc")
    (path, kwargs, loaded), = loads
    assert path == llama_dir and model is loaded
    config = kwargs.pop("distributed_config")
    assert (config.tp_plan, config.tp_size) == ("auto", 2)
    assert kwargs == dict(dtype=torch.float32, revision="abc")
    assert not model.training
    assert model.compiled_with == dict(backend="kvtopo", options={"inductor": False})


def test_dtype_and_inductor_are_passed_on(loads, llama_dir):
    model = load_tensor_parallel(llama_dir, tp_size=1, dtype=torch.bfloat16)
    assert loads[0][1]["dtype"] is torch.bfloat16
    assert model.compiled_with == dict(backend="kvtopo", options={"inductor": True})


@pytest.mark.parametrize("world, refused", [("2", False), ("4", True)])
def test_the_world_size_comes_from_world_size(loads, llama_dir, monkeypatch, world, refused):
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("RANK", "1")  # not the world size: a rank number must not be read as one
    if refused:
        with pytest.raises(ValueError, match="tensor parallel over 4 ranks needs the heads to divide"):
            load_tensor_parallel(llama_dir)
        assert loads == []
    else:
        load_tensor_parallel(llama_dir, inductor=False)
        assert loads[0][1]["distributed_config"].tp_size == 2


def test_no_world_size_and_no_tp_size_says_to_use_torchrun(loads, llama_dir, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="WORLD_SIZE is not set: start one process per rank with torchrun"):
        load_tensor_parallel(llama_dir)
    assert loads == []


@pytest.mark.parametrize("size", [True, False])
def test_a_bool_is_not_a_rank_count(loads, llama_dir, size):
    with pytest.raises(ValueError, match=f"tp_size={size!r} is invalid"):
        load_tensor_parallel(llama_dir, tp_size=size)
    assert loads == []


def test_a_config_without_kv_head_count_counts_query_heads(loads, monkeypatch):
    """Multi-head attention configs may carry no num_key_value_heads: every query head has its own
    kv-head, so 4 heads over 2 ranks divide."""
    from transformers import AutoConfig

    config = types.SimpleNamespace(num_attention_heads=4,
                                   base_model_tp_plan={"layers.*.self_attn.q_proj": "colwise",
                                                       "layers.*.self_attn.o_proj": "rowwise"})
    monkeypatch.setattr(AutoConfig, "from_pretrained", lambda path: config)
    load_tensor_parallel("ckpt", tp_size=2, inductor=False)
    assert len(loads) == 1
    with pytest.raises(ValueError, match="has 4 query heads and 4 kv-heads"):
        load_tensor_parallel("ckpt", tp_size=3)


def test_stored_kv_heads_of_a_single_process_session():
    import kvtopo
    from kvtopo.models import zoo

    model = zoo.build("llama")  # 2 layers, 2 kv-heads of head_dim 16
    compiled = kvtopo.compile(model, inductor=False)
    ids = (torch.arange(40) * 7 % 251 + 1).unsqueeze(0)
    with kvtopo.session(kvtopo.Config.lossless()) as s:
        kvtopo.generate(compiled, ids, max_new_tokens=2)
        heads = stored_kv_heads(s)
        assert len(heads) == model.config.num_hidden_layers
        assert set(heads.values()) == {model.config.num_key_value_heads}
        assert all(s.layers[name].pool.keys.shape[1] == 2 for name in heads)


def test_stored_kv_heads_skips_stores_without_pages():
    pool = types.SimpleNamespace(keys=torch.empty(7, 3, 5, 11))  # [slots, kv-heads, page tokens, head dim]
    session = types.SimpleNamespace(layers={"a": types.SimpleNamespace(pool=None),
                                            "b": types.SimpleNamespace(pool=pool)})
    assert stored_kv_heads(session) == {"b": 3}
