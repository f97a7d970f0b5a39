"""The KV bytes the export checks hold a host runner to are the session's held bytes, its free
pool slots aside (the host runner has no pool). A lossless Llama export (every page exact) run
for 258 tokens ends with a free slot in each layer's pool; onnxruntime must still give the
session's tokens, logits and held bytes. (The compressing configs of the other export tests end
with no free slot, so there the two counts coincide.)"""

import torch

import kvtopo
from kvtopo.config import Config
from kvtopo.models import zoo

from export_common import assert_host_runner_matches_session, graph_config

LOSSLESS = Config.lossless(page_size=16, prefill_chunk_size=64)
PROMPT, NEW = 250, 8


def test_a_lossless_export_holds_the_sessions_bytes_without_its_free_slots(onnx_export, session_references):
    ids, (_, _, reference_bytes) = session_references("llama", graph_config(LOSSLESS), PROMPT, NEW)
    model = kvtopo.compile(zoo.build("llama"), inductor=False)
    with kvtopo.session(graph_config(LOSSLESS)) as s, torch.no_grad():
        kvtopo.generate(model, ids, NEW)
        stats = s.stats()
    assert stats.per_kind["free"] > 0  # the case this test is about
    assert reference_bytes == stats.total_bytes - stats.per_kind["free"]
    out, _ = onnx_export("llama", LOSSLESS, PROMPT + NEW)
    runner = assert_host_runner_matches_session(session_references, "llama", out, LOSSLESS, PROMPT, NEW,
                                                runtimes=("onnxruntime",))["onnxruntime"]
    assert {p.phase.value for layer in runner.layers for p in layer.pages} <= {"initial", "mid", "recent", "terminal"}
    assert all(p.keys is not None for layer in runner.layers for p in layer.pages)  # every page exact
