"""bench/generate_speed.py end to end on the tiny zoo model: the rows it writes and the decode-step
breakdown (the attention op inside the step, the C kernel inside the op)."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from kvtopo.kernels.cpu_decode import c_kernel_available

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "generate_speed.py"


def test_breakdown_nests_and_modes_run_in_order(tmp_path):
    out = tmp_path / "speed.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", "llama", "--prompts", "96", "--new", "4",
                           "--reps", "1", "--modes", "kvtopo", "--breakdown", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["machine"]["torch"] == torch.__version__  # figures are comparable only on one kind of CPU
    rows = result["rows"]
    assert [r["mode"] for r in rows] == ["hf", "kvtopo"]  # the baseline always runs, first
    hf, kv = rows
    assert "breakdown_ms_per_step" not in hf and hf["agreement_with_lossless"] is None
    assert len(kv["tokens"]) == 4 and kv["kv_bytes"] > 0
    b = kv["breakdown_ms_per_step"]
    assert 0 < b["attention_op"] < b["step"]
    if c_kernel_available():
        assert 0 < b["c_kernel"] < b["attention_op"]
    else:
        assert b["c_kernel"] == 0


def test_new_below_two_is_refused():
    done = subprocess.run([sys.executable, str(SCRIPT), "--new", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--new must be >= 2" in done.stderr


def test_rounds_keep_each_figure_best_over_the_rounds(tmp_path):
    out = tmp_path / "speed.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", "llama", "--prompts", "64", "--new", "3",
                           "--reps", "1", "--modes", "kvtopo", "--rounds", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["rounds"] == 2
    for row in result["rows"]:
        assert len(row["round_totals_s"]) == 2 and row["total_s"] == min(row["round_totals_s"])
        assert row["tokens_per_s"] == row["new"] / row["total_s"]
        assert row["decode_tokens_per_s"] == (row["new"] - 1) / row["decode_s"]


def test_zero_rounds_are_refused():
    done = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--rounds must be >= 1" in done.stderr
