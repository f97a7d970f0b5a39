"""The page compressor ranks a page's tokens with the layer's own softmax scale, as the session
scores them (`ScoreInputs.scale`: the attention's scale). The scale reaches the compressor
through the exported layout (`layout.scales`, taken from each attention site) and the host
runner's feed. The topo score's margin is in logit units after the scale, so another scale
keeps other tokens; but on the zoo Llama's pages the greedy tokens and logits of the end-to-end
tests barely depend on which tokens a partly kept Mid page keeps, so a wrong scale there goes
unnoticed. Here the scale the host feeds is checked against the model's own attention scale
(head_dim ** -0.5, from the model's config), and shown to change what the compressor keeps."""

import numpy as np
import torch

from kvtopo.export.host_runner import HostRunner
from kvtopo.models import zoo

from export_common import CONFIG, graph_config

PROMPT = 256
# A tighter byte budget than the export's (the budget is the host's, not the graphs'): every Mid
# page is kept partly (9 or 10 of 16 tokens), so which tokens the score ranks first decides what is held.
BUDGET = 22000


def test_the_compressor_is_fed_each_layers_attention_scale(onnx_export):
    out, _ = onnx_export("llama", CONFIG, PROMPT + 32)  # the export test_onnx.py makes
    config = zoo.build("llama").config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    expected = head_dim ** -0.5
    runner = HostRunner(out, config=graph_config(CONFIG).replace(layer_budget_bytes=BUDGET))
    assert runner.layout.scales == [expected] * config.num_hidden_layers

    calls = []
    run = runner.executor.run

    def recording(graph, feeds):
        result = run(graph, feeds)
        if graph == "compressor":
            calls.append(({k: np.array(v, copy=True) for k, v in feeds.items()}, result))
        return result
    runner.executor.run = recording
    ids = torch.randint(0, runner.layout.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(1)).numpy()
    runner.generate(ids, 8)

    partial = [(f, r) for f, r in calls if int(f["keep"]) < runner.layout.page_size]
    assert calls and partial, "no Mid page was kept partly: the scale would not matter"
    assert all(float(f["scale"]) == np.float32(expected) for f, _ in calls)
    # The scale matters: ranked with scale 1, some partly kept page keeps other tokens.
    changed = 0
    for feeds, result in partial:
        keep = int(feeds["keep"])
        other = run("compressor", {**feeds, "scale": np.array(1.0, np.float32)})
        changed += not np.array_equal(other["kept"][:, :keep], result["kept"][:, :keep])
    assert changed > 0
