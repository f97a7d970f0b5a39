"""bench/decode_python.py: a batch's decode steps timed with the C kernel and with its calls
replaced (the step's Python alone), steps that move pages told apart; bad arguments refused."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtopo.kernels import cpu_decode

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "decode_python.py"
sys.path.insert(0, str(ROOT / "bench"))

import decode_python  # noqa: E402


@pytest.mark.skipif(not cpu_decode.c_kernel_available(), reason="the C kernel cannot be built here")
@pytest.mark.parametrize("path", ["session", "per_sequence"])
def test_batches_are_timed_with_and_without_the_kernel(tmp_path, path):
    out = tmp_path / "dp.json"
    flag = ["--per-sequence"] if path == "per_sequence" else []
    done = subprocess.run([sys.executable, str(SCRIPT), "--batches", "1", "3", "--length", "96", "--steps", "40",
                           "--rounds", "1", "--out", str(out), *flag], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["path"] == path and [row["batch"] for row in result["rows"]] == [1, 3]
    for row in result["rows"]:
        for name in ("step", "python"):
            timed = row[name]
            assert timed["steps"] == 40 and 0 < timed["steps_moving_pages"] < 40  # 40 steps cross a page
            assert all(0 < timed[f"{kind}_median_us"] for kind in ("steady", "moving", "after_move"))
        assert row["python_per_sequence_us"]["mean_us"] == pytest.approx(row["python"]["mean_us"] / row["batch"])


def test_the_kernel_comes_back_after_a_failure():
    real = cpu_decode.mid_kernel
    with pytest.raises(RuntimeError, match="inside"):
        with decode_python.kernel_replaced():
            assert cpu_decode.mid_kernel is decode_python._NullKernel
            raise RuntimeError("inside")
    assert cpu_decode.mid_kernel is real


def test_bad_arguments_are_refused(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--steps", "0", "--out", str(tmp_path / "x.json")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode != 0 and "--steps" in done.stderr and not (tmp_path / "x.json").exists()
