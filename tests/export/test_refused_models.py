"""Models the exported graphs cannot run are refused with the reason, never exported wrong: a
hybrid's state outside attention, a forward that writes module state (a graph output besides the
logits), weights that are not float32. Also the layout's exact capacity, computed by arithmetic."""

import random

import pytest
import torch
import transformers

from kvtopo.config import Config
from kvtopo.models import zoo
from kvtopo.runtime.phases import Phase, PhasePlan

from export_common import export_module, export_package


def _phi3_longrope():
    """Phi-3 with LongRoPE: its rotary embedding stores `long_inv_freq` on itself in the forward."""
    config = transformers.Phi3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=None,
                                     eos_token_id=None, original_max_position_embeddings=64,
                                     max_position_embeddings=4096,
                                     rope_scaling={"type": "longrope", "short_factor": [1.0] * 8,
                                                   "long_factor": [4.0] * 8})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.Phi3ForCausalLM(config).eval()


def test_hybrid_model_is_refused_naming_its_state(tmp_path):
    """The decode step carries only the KV cache: LFM2's convolution state would be dropped between calls."""
    out = tmp_path / "out"
    with pytest.raises(NotImplementedError, match=r"keeps state outside attention \(.*Lfm2ShortConv.*\), which the "
                                                  r"exported decode step does not carry between calls"):
        export_package().export_onnx(zoo.lfm2_hybrid(), out, max_context=64)
    assert not out.exists()  # refused before the directory is made


def test_graph_returning_more_than_the_logits_is_refused():
    """The extra output is module state the forward writes; DecodeStep would have taken it for the logits."""
    with pytest.raises(NotImplementedError, match=r"returns 2 outputs \(.*long_inv_freq.*\).*writes module state"):
        export_module("decode_step").capture(_phi3_longrope())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_non_float32_model_is_refused_and_left_as_it_is(dtype):
    model = zoo.build("llama").to(dtype)
    with pytest.raises(ValueError, match=rf"{str(dtype).removeprefix('torch.')} parameters.*pass a float32 model"):
        export_module("decode_step").capture(model)
    assert {p.dtype for p in model.parameters()} == {dtype}


def _most_exact_by_enumeration(plan: PhasePlan, pages: int, exact_phases) -> int:
    """Pages in `exact_phases` at the sequence length that holds the most, page by page."""
    return max(sum(plan.phase(i, n) in exact_phases for i in range(n)) for n in range(1, pages + 1))


@pytest.mark.parametrize("seed", range(4))
def test_exact_capacity_is_the_most_exact_pages_at_any_length(seed):
    """CacheLayout.build sizes the exact buffers by arithmetic; every length up to max_context,
    enumerated, holds no more exact pages (protected spans, Recent and Mid stored exactly or not)."""
    rng = random.Random(seed)
    spans = lambda: tuple(sorted((s, s + rng.randint(1, 40)) for s in rng.sample(range(200), 2)))  # noqa: E731
    configs = [Config.lossless(page_size=16, sink_tokens=16, recent_tokens=32)] + [
        Config(page_size=rng.choice([1, 4, 16]), sink_tokens=rng.randint(0, 48), recent_tokens=rng.randint(0, 64),
               target_ratio=None, protected_spans=spans(),
               **rng.choice([{"policy": "topo"}, {"policy": "topo", "recent_bits": None}, {"policy": "kivi"}]))
        for _ in range(12)]
    for config in configs:
        for max_context in (1, 16, 100, rng.randint(1, 600)):
            layout = export_module("layout").CacheLayout.build(
                config, max_context, layer_names=["a"], scales=[0.25], heads=4, kv_heads=2, head_dim=16,
                value_head_dim=16, vocab_size=32)
            exact = {Phase.INITIAL, Phase.TERMINAL} | ({Phase.RECENT} if layout.recent_bits is None else set()) \
                | ({Phase.MID} if layout.mid_bits is None else set())
            pages = -(-max_context // config.page_size)
            plan = export_module("layout").plan_of(config)
            assert layout.exact_capacity == config.page_size * _most_exact_by_enumeration(plan, pages, exact), config
