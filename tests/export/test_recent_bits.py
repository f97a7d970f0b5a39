"""Recent pages at fewer than 8 bits (`recent_bits` 4 and 2: keys per page and channel, values per
token, two or four codes per byte) export and run as the PyTorch session does: the decode step's
dequantized Recent equals what the host runner's pages decode to, and greedy generation through
onnxruntime gives the session's tokens, logits and KV bytes.

Coarser codes make the comparison more sensitive to float rounding, not different: where the two
executors compute a value a rounding apart, a statistic rounded to float16 or a code rounded to
its level can land on the other side and move by a whole (4-bit or 2-bit) step. On the random-weight
zoo model that leaves the logits within the float32 tolerance, but a long greedy run can reach a
near-tie the session decides by less than that; so the runs here stay short."""

import numpy as np
import pytest
import torch

from kvtopo.export.attention import LayerCacheTensors, dequantize_recent

from export_common import CONFIG, assert_host_runner_matches_session

PROMPT, NEW = 64, 16  # 80 tokens at page_size 16: Initial, Mid, Recent and Terminal pages


def _graph_recent(layer, layout):
    """The decode step's dequantized Recent keys and values from a layer's host buffers."""
    layer._refill()
    tensors = {n: torch.from_numpy(np.asarray(a)) for n, a in layer.buffers.items()}
    tensors = {n: t if t.dtype == torch.uint8 else t.float() for n, t in tensors.items()}
    cache = LayerCacheTensors(**{n: tensors.get(n) for n in LayerCacheTensors.names()})
    return dequantize_recent(cache, layout.page_size, layout.recent_code_bits)


@pytest.mark.parametrize("bits", [4, 2])
def test_low_bit_recent_matches_session(bits, onnx_export, session_references):
    config = CONFIG.replace(recent_bits=bits)
    out, _ = onnx_export("llama", config, PROMPT + NEW)
    runner = assert_host_runner_matches_session(session_references, "llama", out, config, PROMPT, NEW,
                                                runtimes=("onnxruntime",))["onnxruntime"]
    assert runner.layout.recent_bits == runner.layout.recent_code_bits == bits
    for layer in runner.layers:
        pages = [p.recent for p in layer.seq.pages if p.recent is not None]
        assert pages and all(p.keys.bits == p.values.bits == bits for p in pages)
        keys, values = zip(*(p.decode() for p in pages))
        keys, values = torch.cat(keys, 1), torch.cat(values, 1)
        graph_keys, graph_values = _graph_recent(layer, runner.layout)
        n = keys.shape[1]
        assert torch.equal(graph_keys[:, :n], keys) and torch.equal(graph_values[:, :n], values)
