"""bench/decode_speed.py's batch mode: every timed step's two floors come from the same run's read
and sgemm rates, and the time over each floor is reported under that floor's name (the README
once quoted the time over the larger floor as the time over the read floor)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "decode_speed.py"


def test_batch_rows_report_the_time_over_each_floor(tmp_path):
    out = tmp_path / "ds.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--batch", "2", "--lengths", "512", "--configs", "8x",
                           "--reps", "1", "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    [row] = result["rows"]
    assert row["8x"]["rel_err_vs_float64_on_stored_max"] < 1e-4
    read_bytes_per_ms = row["read"]["bytes"] / row["read"]["min_ms"]
    flops_per_ms = row["sgemm"]["flops"] / row["sgemm"]["min_ms"]
    for name in ("dense_fp32", "dense_fp32_one", "8x_batched", "8x_singles", "8x_one"):
        entry = row[name]
        floors = entry["floor_ms"]
        assert floors["bandwidth"] == pytest.approx(entry["bytes"] / read_bytes_per_ms)
        assert floors["arithmetic"] == pytest.approx(entry["flops"] / flops_per_ms)
        over = entry["min_over_each_floor"]
        assert over == pytest.approx({k: entry["min_ms"] / v for k, v in floors.items()})
        assert entry["min_over_floor"] == pytest.approx(min(over.values()))  # over the larger floor
    summary = result["summary"]["512"]["8x"]
    assert summary["one_min_over_each_floor"] == row["8x_one"]["min_over_each_floor"]
    assert summary["batched_min_over_each_floor"] == row["8x_batched"]["min_over_each_floor"]
    assert "read floor" in done.stdout and "arithmetic floor" in done.stdout


@pytest.mark.parametrize("mode", [[], ["--batch", "2", "--configs", "default", "8x"]], ids=["one sequence", "batch"])
def test_every_config_in_one_run_writes_its_json_and_command(tmp_path, mode):
    """Each config has a session of its own, all entered at once: they must exit in the reverse order
    (a session refuses any other), or the run ends in an error before it writes anything."""
    out = tmp_path / "ds.json"
    args = [*mode, "--lengths", "512", "--reps", "1", "--out", str(out)]
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["command"] == " ".join(["bench/decode_speed.py", *args])
    assert {"default", "8x"} <= set(result["rows"][0])
