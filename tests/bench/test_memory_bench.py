"""bench/memory.py --quick runs to its JSON: every policy measured at 4K, bytes that add up."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "memory.py"


def test_quick_run_measures_every_policy_and_records_its_command(tmp_path):
    out = tmp_path / "memory.json"
    args = ["--quick", "--no-match", "--out", str(out)]
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]  # it once ended in a NameError in `structure`
    result = json.loads(out.read_text())
    assert result["command"] == " ".join(["bench/memory.py", *args])
    runs = result["results"]["4096"]["runs"]
    assert set(runs) == {"topo", "full", "streaming", "snapkv", "h2o", "knorm", "kivi", "palu"}
    for policy, run in runs.items():
        default = run["default"]
        assert default["total_bytes"] == sum(default["per_kind"].values()), policy
        assert 0 <= default["error"] < 2, policy
    assert runs["full"]["default"]["error"] < 1e-3  # exact but for the float16 output's rounding (2e-4)
