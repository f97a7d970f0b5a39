"""bench/served_memory.py on the tiny zoo model: each mode served in its own process, the rows it
writes (the engine's own cache is left out here: it sizes itself to most of the machine's memory)."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "served_memory.py"


def test_each_mode_reports_its_own_process_and_bad_sizes_are_refused(tmp_path):
    out = tmp_path / "memory.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", "zoo-llama", "--prompts", "2", "--prompt-tokens",
                           "48", "--new-tokens", "3", "--modes", "kvtopo", "kvtopo-lossless", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [r["mode"] for r in report["rows"]] == ["kvtopo", "kvtopo-lossless"]
    for r in report["rows"]:
        assert r["generated_tokens"] == 6 and r["kv_peak_mb"] > 0
        assert r["serving_peak_rss_mb"] >= r["rss_before_mb"] > 0 and r["process_peak_rss_mb"] > 0
    assert report["meta"]["prompts"] == 2 and len(report["meta"]["commit"]) == 40
    assert report["meta"]["machine"]["cpus"] == os.cpu_count()
    bad = subprocess.run([sys.executable, str(SCRIPT), "--prompts", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--prompts" in bad.stderr
