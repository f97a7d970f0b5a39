"""HostRunner(config=...) refuses a config that differs from the exported one in anything the
exported graphs bake in: the compressor's score margin and observation window, the phase plan
the buffers are sized by, the code widths. Accepted, the host would run the session's lifecycle
of one config over graphs of another: a score margin the compressor does not use ranks a page's
tokens differently from a session of that config, with nothing to say so."""

import pytest

from kvtopo.export.host_runner import HostRunner

from export_common import CONFIG, graph_config

PROMPT, NEW = 256, 32  # the export test_onnx.py makes (shared through the onnx_export fixture)


@pytest.mark.parametrize("change", [dict(score_margin=CONFIG.score_margin * 4), dict(observation_window=8),
                                    dict(sink_tokens=32), dict(recent_tokens=64), dict(page_size=8),
                                    dict(mid_bits=2), dict(recent_bits=4)],
                         ids=lambda change: next(iter(change)))
def test_a_config_differing_in_what_the_graphs_bake_in_is_refused(change, onnx_export):
    out, _ = onnx_export("llama", CONFIG, PROMPT + NEW)
    exported = graph_config(CONFIG)
    assert HostRunner(out).config == exported
    with pytest.raises(ValueError, match=rf"differs from the exported one in \['{next(iter(change))}'\].*re-export"):
        HostRunner(out, config=exported.replace(**change))
    # What the graphs do not depend on may differ (here the byte budget).
    assert HostRunner(out, config=exported.replace(layer_budget_bytes=30000)).config.layer_budget_bytes == 30000
