"""A model whose attention softcaps its logits (Gemma-2: `softcap * tanh(logits / softcap)`
before the softmax) is refused by export, naming the layers, even when no layer has a sliding
window. The exported decode step's cached attention (export/attention.py) has no softcap: a
softcapped model exported anyway would attend with uncapped logits and give other tokens than
the PyTorch session, with nothing to say so. (test_export_cli.py covers the sliding-window
refusal; Gemma-2's default layers have both, so this builds one with full attention only.)"""

import pytest

from kvtopo.models import zoo

from export_common import CONFIG, export_package


def test_softcapped_attention_without_windows_is_refused(tmp_path):
    model = zoo.build("gemma2", attn_implementation="eager", layer_types=["full_attention"] * 4)
    assert model.config.attn_logit_softcapping == 50.0
    out = tmp_path / "out"
    with pytest.raises(NotImplementedError, match=r"logit softcapping.*model\.layers\.0\.self_attn \(window=None, "
                                                  r"softcap=50\.0"):
        export_package().export_onnx(model, out, config=CONFIG, max_context=64)
    assert not out.exists()  # refused before the directory is made
