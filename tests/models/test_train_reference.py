"""The training script's data stream and checkpoint loading (not training itself: too slow here)."""

import json
import random

import pytest
import torch

from kvtopo.models import train_reference as TR


def _specs(n=4, seed=0):
    rng = random.Random(seed)
    return [(rng.getrandbits(63), rng.choice([128, 256]), 1024, 0.1, 4, 0.3, 0.3) for _ in range(n)]


def test_worker_processes_build_the_same_batches_as_inline():
    """Each batch is fixed by the seed the main process draws, so --workers changes speed only."""
    specs = _specs()
    inline = [TR.BatchStream(0).next(lambda s=s: s) for s in specs]
    stream = TR.BatchStream(2)
    try:
        it = iter(specs)
        pooled = [stream.next(lambda: next(it, specs[-1])) for _ in specs]
    finally:
        stream.close()
    for a, b in zip(inline, pooled):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert not torch.equal(inline[0][0], TR.batch_from_seed(specs[1][0], *specs[0][1:])[0])  # the seed matters


def test_init_from_refuses_weights_of_another_architecture(tmp_path):
    with pytest.raises(SystemExit, match="do not fit this architecture"):
        TR.main(["--init-from", TR.R.REFERENCE_DIR, "--hidden", "64", "--out", str(tmp_path), "--minutes", "0.01"])


def test_eval_only_writes_what_it_prints(tmp_path):
    out = tmp_path / "eval.json"
    results = TR.main(["--eval-only", "--out", TR.R.REFERENCE_DIR, "--n-eval", "2", "--eval-lengths", "512",
                       "--results", str(out)])
    assert json.loads(out.read_text()) == results
    assert set(results["accuracy"]) == {f"{task}@512" for task in TR.T.TASKS}
    assert all(0 <= acc <= 1 for acc in results["accuracy"].values())
    assert results["heldout_tokens"] > 0 and results["heldout_ppl"] > 1
