"""`bench/quality.py --quick` end to end on the reference model: JSON structure and sane values.

Runs in a subprocess (a fresh Dynamo and a fresh torch thread setting, like a user's run),
writing into a tmp dir through --out. Skipped when the reference checkpoint is absent.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "quality.py"
TASKS = ("passkey", "multikey", "multivalue", "vartrack")


def _checkpoint() -> Path:
    from kvtopo.models.reference import REFERENCE_DIR

    return Path(REFERENCE_DIR) / "model.safetensors"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    assert _checkpoint().exists(), "the reference checkpoint ships in models/reference/"
    out = tmp_path_factory.mktemp("quality")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TQDM_DISABLE="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    path = out / "quality_quick.json"
    assert path.exists(), sorted(p.name for p in out.iterdir())
    return json.loads(path.read_text()), out, proc.stdout


def test_structure(report):
    data, out, stdout = report
    assert set(data) >= {"meta", "plans", "skipped", "results", "perplexity", "scoring", "examples"}
    meta = data["meta"]
    assert meta["lengths"] == [512] and meta["examples"] == 1 and meta["ratios"] == [2.0, 8.0]
    assert meta["policies"][0] == "full" and 2 <= len(meta["policies"]) <= 3
    assert meta["windows"]["page_size"] == 16 and meta["windows"]["sink_tokens"] == 16
    keys = {(r["policy"], r["nominal"], r["task"], r["length"]) for r in data["results"]}
    expected = {(p["policy"], p["nominal"], t, 512) for p in data["plans"]["512"] for t in TASKS}
    assert keys == expected
    for task in TASKS:
        assert (out / f"quality_quick_{task}.png").stat().st_size > 1000
    assert "policy" in stdout and "wrote" in stdout  # the printed table


def test_values_are_sane(report):
    data, _, _ = report
    for r in data["results"]:
        assert 0.0 <= r["accuracy"] <= 1.0
        assert 0.0 <= r["agree"] <= 1.0 and 0.0 <= r["agree_prefix"] <= r["agree"] + 1e-9
        assert 0.0 <= r["budget_missed"] <= 1.0
        assert r["kl"] >= 0.0 and math.isfinite(r["kl"])
        assert r["ratio"] > 0 and r["ratio_live"] >= r["ratio"]
        if r["policy"] == "full":  # the reference is a lossless run too: equal unless state leaks between runs
            assert r["kl"] == 0.0 and r["agree"] == 1.0, r
        else:
            assert r["ratio"] > 1.0, r
    # A tighter nominal budget never holds more bytes.
    by = {(r["policy"], r["nominal"], r["task"]): r["ratio"] for r in data["results"]}
    for (policy, nominal, task), ratio in by.items():
        if policy != "full" and nominal == 8.0:
            assert ratio >= by[(policy, 2.0, task)] - 1e-9
    for p in data["perplexity"]:
        assert p["ppl"] > 1.0 and p["ppl_full"] > 1.0
        assert p["ppl_vs_full"] == pytest.approx(p["ppl"] / p["ppl_full"], rel=1e-9)  # compressed over full
        if p["policy"] == "full":
            assert p["ppl_vs_full"] == pytest.approx(1.0, abs=1e-9)


def test_scoring_agreement(report):
    scoring = report[0]["scoring"]
    assert scoring["budgets"] == [0.1, 0.25, 0.5]
    assert len(scoring["per_layer"]) == 3  # the reference model's layers
    for layer in scoring["per_layer"].values():
        assert set(layer) == {f"{s}@{b}%" for s in ("global", "per_page") for b in (10, 25, 50)}
        for cell in layer.values():
            assert 0.0 <= cell["recall"] <= 1.0
            assert 0.0 <= cell["mass_kept"] <= 1.0 + 1e-6
