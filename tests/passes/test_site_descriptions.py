"""What a report says of each site it rewrote (`AttentionSite.describe`, shown by
`kvtopo.inspect(...).format()` and the CLI): its heads and dims, its scale to four significant
digits (or the graph input a scale Dynamo made symbolic arrives in), how it is masked, and its
window, logit cap and sinks when it has them."""

import torch
import torch.fx as fx

import kvtopo
from kvtopo.models.blocks import SDPACausal
from kvtopo.passes.site import AttentionSite, format_scale


def _site(**changes):
    fields = dict(layer="model.layers.0.self_attn", pattern="eager", query=None, key=None, value=None, masks=(),
                  scale=0.125, is_causal=True, heads=8, kv_heads=2, head_dim=64, value_head_dim=64, output=None)
    return AttentionSite(**{**fields, **changes})


def test_an_sdpa_site_found_in_a_block_describes_itself():
    report = kvtopo.inspect(SDPACausal().eval(), torch.randn(1, 5, 32))
    assert len(report.sites) == 1, report.format()
    assert report.sites[0].describe().endswith(
        ": sdpa, heads=4 kv_heads=2 head_dim=8 v_head_dim=8 scale=0.3536 causal")


def test_window_softcap_and_sinks_are_named():
    assert _site().describe() == ("model.layers.0.self_attn: eager, heads=8 kv_heads=2 head_dim=64 v_head_dim=64 "
                                  "scale=0.125 causal")
    site = _site(window=4096, softcap=50.0, sinks=object(), is_causal=False, masks=((None, "bool"), (None, "additive")))
    assert site.describe().endswith("scale=0.125 bool+additive mask window=4096 softcap=50 sinks")
    assert _site(is_causal=False).describe().endswith("scale=0.125 no mask")


def test_a_scale_prints_four_significant_digits_or_the_node_it_arrives_in():
    assert format_scale(1 / 3) == "0.3333"
    assert format_scale(0.0883883476) == "0.08839"
    graph = fx.Graph()
    node = graph.placeholder("l_self_scaling")
    assert format_scale(node) == "l_self_scaling"
