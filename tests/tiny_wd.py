"""A tiny WD tagger in the published layout (``model.onnx`` + ``selected_tags.csv``), torch-free: its scores are set
by biases, two of them computed from the prepared image (the BGR channel means of the model's input, 0-1):
bgr_red = 12 (R - B) - 6, white_pad = 12 G - 6. ``tests/test_captioners.py`` exports the same network with torch's
ONNX exporter; the browser test writes this one (no torch in its process)."""

from __future__ import annotations

from pathlib import Path
from typing import Tuple

import numpy as np

# selected_tags.csv: (name, category, logit); category 9 rating, 0 general, 4 character; None: from the image
TABLE = [("general", 9, 2.0), ("sensitive", 9, 3.0), ("questionable", 9, -1.0), ("explicit", 9, -3.0),
         ("1girl", 0, 3.0), ("long_hair", 0, 1.0), ("bgr_red", 0, None), ("white_pad", 0, None), ("^_^", 0, 0.0),
         ("shirt_(red)", 0, -0.2), ("solo", 0, 2.0), ("low_score", 0, -3.0), ("hatsune_miku", 4, 1.5),
         ("lowchar", 4, -1.0)]
SIZE = 16  # the tagger's input side, read from the ONNX input shape


def weights() -> Tuple[np.ndarray, np.ndarray]:
    """[3, tags] weights on the channel means and [tags] biases (logits)."""
    weight, bias = np.zeros((3, len(TABLE)), np.float32), np.zeros(len(TABLE), np.float32)
    for i, (_, _, logit) in enumerate(TABLE):
        bias[i] = -6.0 if logit is None else logit
    weight[2, 6], weight[0, 6] = 12.0, -12.0  # bgr_red: channel 2 is red when the input is BGR
    weight[1, 7] = 12.0  # white_pad: green, which only the white padding of a red image has
    return weight, bias


def write_tags(folder: Path) -> None:
    rows = ["tag_id,name,category,count"] + [f"{1000 + i},{n},{c},10" for i, (n, c, _) in enumerate(TABLE)]
    (folder / "selected_tags.csv").write_text("\n".join(rows) + "\n", encoding="utf-8")


def write_tiny_wd_onnx(folder: Path) -> Path:
    """The tagger's graph written with onnx's helpers: sigmoid(mean over H, W / 255 @ weight + bias)."""
    from onnx import TensorProto, helper, numpy_helper, save  # the test extra's onnx
    folder.mkdir(parents=True, exist_ok=True)
    weight, bias = weights()
    nodes = [helper.make_node("ReduceMean", ["input", "axes"], ["mean"], keepdims=0),
             helper.make_node("Div", ["mean", "scale"], ["unit"]),
             helper.make_node("MatMul", ["unit", "weight"], ["logits0"]),
             helper.make_node("Add", ["logits0", "bias"], ["logits"]),
             helper.make_node("Sigmoid", ["logits"], ["output"])]
    inits = [numpy_helper.from_array(np.array([1, 2], np.int64), "axes"),
             numpy_helper.from_array(np.array(255.0, np.float32), "scale"),
             numpy_helper.from_array(weight, "weight"), numpy_helper.from_array(bias, "bias")]
    graph = helper.make_graph(nodes, "tiny-wd", [helper.make_tensor_value_info(
        "input", TensorProto.FLOAT, ["batch", SIZE, SIZE, 3])], [helper.make_tensor_value_info(
            "output", TensorProto.FLOAT, ["batch", len(TABLE)])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    save(model, str(folder / "model.onnx"))
    write_tags(folder)
    return folder
