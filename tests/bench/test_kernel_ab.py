"""bench/kernel_ab.py: two builds of the kernel source alternate on one store; both are checked
against the float64 reference, and a revision git does not know is refused by name."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtopo.kernels.cpu_decode import c_kernel_available

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "kernel_ab.py"

needs_git_checkout = pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                                        reason="needs git and the project's repository")


@needs_git_checkout
@pytest.mark.skipif(not c_kernel_available(), reason="the C kernel cannot be built here")
@pytest.mark.parametrize("layer, heads", [("llama3-8b", (32, 8, 128)), ("smollm2", (9, 3, 64))])
def test_both_builds_are_timed_and_checked(tmp_path, layer, heads):
    out = tmp_path / "ab.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--base", "HEAD", "--configs", "8x", "--length", "1024",
                           "--layer", layer, "--rounds", "2", "--calls", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["machine"]["cpus"] == os.cpu_count()
    assert (result["layer"]["q_heads"], result["layer"]["kv_heads"], result["layer"]["head_dim"]) == heads
    assert result["builds"]["base"]["revision"] == "HEAD" and result["builds"]["candidate"]["commit"] == "WORKTREE"
    source_diff = subprocess.run(["git", "diff", "HEAD", "--", "kernels/csrc/mid_decode.cpp"], capture_output=True,
                                 text=True, cwd=ROOT).stdout
    assert result["builds"]["candidate"]["diff_from_head"] == source_diff  # an uncommitted candidate can be rebuilt
    row = result["configs"]["8x"]
    assert set(row["rel_err_vs_float64"]) == {"base", "candidate"}
    assert all(err < 1e-4 for err in row["rel_err_vs_float64"].values())
    for role in ("base", "candidate"):
        assert 0 < row[role]["min_ms"] <= row[role]["median_of_round_minima_ms"]
    assert row["candidate_over_base"]["min"] == pytest.approx(row["candidate"]["min_ms"] / row["base"]["min_ms"])


@needs_git_checkout
def test_an_unknown_revision_is_refused_by_name(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--base", "no-such-revision", "--out", str(tmp_path / "x.json")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode != 0 and "no-such-revision" in done.stderr
    assert not (tmp_path / "x.json").exists()
