"""MLIR export: every output type of both graphs is written and names its entry function; the
compressor's linalg contains no exponential; a lowering failure names the op; the MLA model
(DeepSeek-V3) lowers too, with no kvtopo op and the latent cache as its inputs."""

import re

import pytest
import torch
from torch import nn

from export_common import CONFIG, export_module, export_package

TYPES = ("torch", "linalg-on-tensors", "stablehlo")
EXP_MARKERS = {"torch": "torch.aten.exp", "linalg-on-tensors": "math.exp", "stablehlo": "stablehlo.exponential"}


@pytest.fixture(scope="module")
def mlir_files(tmp_path_factory):
    out = tmp_path_factory.mktemp("mlir")
    return export_package().export_mlir("llama", out, config=CONFIG, max_context=128)


@pytest.mark.parametrize("graph,entry", [("decode_step", "decode_step"), ("compressor", "compressor")])
@pytest.mark.parametrize("output_type", TYPES)
def test_every_output_is_written_with_its_entry(mlir_files, graph, entry, output_type):
    text = open(mlir_files[f"{graph}.{output_type}"]).read()
    assert f"func.func @{entry}(" in text
    if output_type == "linalg-on-tensors":
        assert "linalg." in text and "torch.aten" not in text
    if output_type == "stablehlo":
        assert "stablehlo." in text and "torch.aten" not in text


@pytest.mark.parametrize("output_type", TYPES)
def test_compressor_mlir_is_exponential_free(mlir_files, output_type):
    text = open(mlir_files[f"compressor.{output_type}"]).read()
    assert EXP_MARKERS[output_type] not in text
    assert "math.exp" not in text
    # The decode step does attend with exponentials: the check would see them.
    assert EXP_MARKERS[output_type] in open(mlir_files[f"decode_step.{output_type}"]).read()


@pytest.fixture(scope="module")
def mla_mlir_files(tmp_path_factory):
    out = tmp_path_factory.mktemp("mla_mlir")
    return export_package().export_mlir("deepseek-v3", out, config=CONFIG, max_context=128)


@pytest.mark.parametrize("output_type", TYPES)
def test_mla_decode_step_lowers_without_kvtopo_ops(mla_mlir_files, output_type):
    for graph in ("decode_step", "compressor"):
        text = open(mla_mlir_files[f"{graph}.{output_type}"]).read()
        assert f"func.func @{graph}(" in text
        assert "kvtopo" not in text
        assert not re.search(r"torch\.aten\.(sort|topk)|stablehlo\.sort|tm_tensor\.sort", text)  # routers: topk_by_rank
        if output_type != "torch":
            assert "torch.aten" not in text and "torch.operator" not in text
    # Inputs: ids, positions, lengths and 10 tensors per layer (latent + RoPE key cache, no values).
    text = open(mla_mlir_files[f"decode_step.{output_type}"]).read()
    signature = re.search(r"func\.func @decode_step\((.*?)\) ->", text, re.S).group(1)
    assert len(re.findall(r"%arg\d+:", signature)) == 3 + 2 * 10, signature


class _Unlowerable(nn.Module):
    def forward(self, x):
        return torch.special.bessel_j0(x)


def test_lowering_failure_names_the_op():
    mlir = export_module("mlir_export")
    with pytest.raises(mlir.MlirLoweringError, match="bessel_j0"):
        mlir.lower(_Unlowerable(), (torch.randn(3),), "linalg-on-tensors", "f")


def test_dynamic_token_decode_step_lowers_to_stablehlo(tmp_path):
    """The model's own attention mask (Hugging Face's packed-sequence cumsum, which stablehlo cannot
    take with a dynamic token count) is dead in the decode step and does not reach the graph."""
    paths = export_package().export_mlir("llama", tmp_path, config=CONFIG, max_context=64,
                                         output_types=("stablehlo",), tokens=None)
    text = open(paths["decode_step.stablehlo"]).read()
    assert "x?x" in export_module("mlir_export").signature(text, "decode_step")  # ids [1, ?]: dynamic


def test_failed_lowering_leaves_no_directory(tmp_path, monkeypatch):
    mlir = export_module("mlir_export")
    monkeypatch.setattr(mlir, "export_graphs", lambda *args: (None, {"decode_step": (_Unlowerable(), (torch.randn(3),),
                                                                                      None)}))
    with pytest.raises(mlir.MlirLoweringError, match="bessel_j0"):
        export_package().export_mlir("llama", tmp_path / "out", output_types=("linalg-on-tensors",))
    assert not (tmp_path / "out").exists()


def test_iree_stablehlo_needs_static_graphs(tmp_path):
    with pytest.raises(ValueError, match="stablehlo.*needs profile='npu'.*dynamic token count"):
        export_package().export_iree("llama", tmp_path / "out", output_type="stablehlo")
    assert not (tmp_path / "out").exists()
