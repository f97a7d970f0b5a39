"""The host runner counts a Mid side's statistics as the session does once one page needed
float32: `runtime.codecs.MidSegment` switches the whole side (keys or values) to float32
statistics for good when a page's values lie beyond float16's range, and later pages that
float16 could hold do not switch it back. The host's byte count drives the same budget as the
session's, so a count that forgot the switch would evict at other points (and report other KV
bytes) on models with outlier activations. The random-weight zoo models never reach float16's
range, so the end-to-end export tests do not see this: here one layer of the host runner and the
session's LayerCache take the same keys, values and queries page by page, one page's values
scaled beyond 65504, and must hold the same bytes after every page."""

import pytest
import torch

from kvtopo.export.host_runner import HostRunner
from kvtopo.runtime.layer_cache import LayerCache
from kvtopo.runtime.policies import make_policy

from export_common import CONFIG, graph_config

P, KV_HEADS, HEADS, DIM = 16, 2, 4, 16


@pytest.mark.parametrize("side", ["values", "keys"])
def test_float32_statistics_stay_counted_after_later_float16_pages(side, onnx_export):
    out, _ = onnx_export("llama", CONFIG, 256 + 32)  # the export test_onnx.py makes
    config = graph_config(CONFIG).replace(layer_budget_bytes=None)  # every Mid page kept whole
    layer = HostRunner(out, config=config).layers[0]
    session = LayerCache(config, make_policy(config))
    session.scale = layer.scale
    g = torch.Generator().manual_seed(0)
    held = []
    for page in range(10):
        keys, values = torch.randn(KV_HEADS, P, DIM, generator=g), torch.randn(KV_HEADS, P, DIM, generator=g)
        if page == 1:  # the first page to reach Mid: beyond float16's range
            if side == "values":
                values = values * 1e5
            else:
                keys = keys * 1e5
        queries = torch.randn(HEADS, P, DIM, generator=g)
        layer.observe(layer.seq, queries, KV_HEADS)
        layer.seq.prompt_end = 0
        layer.append(keys, values)
        session.observe(0, queries, KV_HEADS)
        session.append(0, keys, values)
        held.append((layer.sequence_nbytes(layer.seq), session.sequence_nbytes(session._entry(0))))
    phases = [p.phase.value for p in layer.pages]
    assert phases.count("mid") >= 4, phases  # float16-range pages entered Mid after the float32 one
    assert layer.mid_f32 == [side == "keys", side == "values"]
    assert [h for h, _ in held] == [s for _, s in held]
