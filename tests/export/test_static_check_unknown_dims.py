"""`onnx_export.dynamic_dims`, the check the "npu" profile's ONNX export runs before it writes a
graph an NPU compiler would take as fully static, flags every input or output dimension that is
not a number: a named symbol (`dim_param`), and also a dimension shape inference left unknown
(neither a value nor a name), which is just as dynamic to a compiler. (test_npu_profile.py
checks a symbol and an unknown rank.)"""

from onnx import TensorProto, helper

from export_common import export_module


def test_unknown_dimensions_count_as_dynamic():
    dynamic_dims = export_module("onnx_export").dynamic_dims
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, None, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [None, 8])])
    model = helper.make_model(graph)
    dim = model.graph.input[0].type.tensor_type.shape.dim[1]
    assert not dim.HasField("dim_value") and not dim.HasField("dim_param")  # the case this test is about
    assert dynamic_dims(model) == ["x[1]", "y[0]"]
    static = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 3])])
    assert dynamic_dims(helper.make_model(static)) == []
