"""`mlir_export._failed_ops` reads the ops torch-mlir could not lower from its diagnostics, for
the first line of `MlirLoweringError` (what `kvtopo export mlir` users read): every "failed to
legalize operation '<op>'" named once, sorted, an op torch-mlir does not know by the `name` of its
generic `torch.operator` (the wrapper's name says nothing); nothing from text without such a line.
test_mlir.py's lowering-failure check matches the op's name anywhere in the message, which the
diagnostics quoted below the first line always satisfy, so it cannot tell whether they were parsed."""

import pytest
import torch
from torch import nn

from export_common import export_module


@pytest.mark.parametrize("text, ops", [
    ("x.mlir:3:5: error: failed to legalize operation 'torch.aten.special_bessel_j0'\n", ["torch.aten.special_bessel_j0"]),
    ("error: failed to legalize operation 'b.op'\nerror: failed to legalize operation 'a.op'\n"
     "error: failed to legalize operation 'b.op'", ["a.op", "b.op"]),
    ("nothing recognisable", []),
    ("error: failed to legalize operation 'torch.operator' that was explicitly marked illegal\n"
     '%0 = "torch.operator"(%arg0) <{name = "torch.aten.special_bessel_j0"}> : (!torch.vtensor) -> !torch.vtensor',
     ["torch.aten.special_bessel_j0"]),
], ids=["one", "sorted-once", "none", "unknown-op"])
def test_failed_ops_are_read_from_the_diagnostics(text, ops):
    assert export_module("mlir_export")._failed_ops(text) == ops


class _Unlowerable(nn.Module):
    def forward(self, x):
        return torch.special.bessel_j0(x)


def test_the_first_line_names_the_unlowered_op():
    """End to end: torch-mlir wraps `special_bessel_j0`, which it does not know, in a `torch.operator`."""
    mlir = export_module("mlir_export")
    with pytest.raises(mlir.MlirLoweringError) as err:
        mlir.lower(_Unlowerable(), (torch.randn(3),), "linalg-on-tensors", "f")
    first = str(err.value).splitlines()[0]
    assert first.startswith("torch-mlir could not lower f to 'linalg-on-tensors': op(s) "), first
    assert "bessel_j0" in first and first.endswith("could not be lowered"), first
