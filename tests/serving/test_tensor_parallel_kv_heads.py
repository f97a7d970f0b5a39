"""load_tensor_parallel refuses a world size that splits a GQA group's kv-heads, even when the
query heads divide by it (tests/serving/test_tensor_parallel.py refuses tp_size=3, where neither
divides): on 4 ranks the zoo Llama's 2 kv-heads would leave ranks with half a kv-head."""

import pytest


class _Loaded(Exception):
    pass


@pytest.mark.parametrize("size,refused", [(4, True), (2, False), (1, False)])
def test_kv_heads_must_divide_by_the_ranks_too(size, refused, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from kvtopo.models import zoo
    from kvtopo.serving.tensor_parallel import load_tensor_parallel

    config = zoo.build("llama").config
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)

    def load(*args, **kwargs):
        raise _Loaded

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", load)
    config.save_pretrained(tmp_path)
    if refused:
        with pytest.raises(ValueError, match="needs the heads to divide: LlamaConfig has 4 query heads and 2 kv-heads"):
            load_tensor_parallel(tmp_path, tp_size=size)
    else:
        with pytest.raises(_Loaded):  # passed the check, went on to load the shards
            load_tensor_parallel(tmp_path, tp_size=size)
