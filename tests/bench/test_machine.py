"""bench/machine.py: what every bench records of the CPU it ran on and of the command that ran it."""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import machine  # noqa: E402


def test_the_record_names_this_cpu_and_the_isa_cap(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    record = machine.describe_machine()
    assert record["onednn_max_cpu_isa"] == "AVX512_CORE"  # a capped run is told apart from an uncapped one
    assert record["cpus"] == os.cpu_count() and record["torch"] == torch.__version__
    assert record["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    model, flags = machine._cpuinfo()
    assert record["cpu_flags"] == [f for f in machine._FLAGS if f in flags]
    if model is not None:
        assert record["cpu"] == model
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert machine.describe_machine()["onednn_max_cpu_isa"] is None


def test_the_command_repeats_the_run_as_the_docs_quote_it(monkeypatch):
    script = str(Path(machine.__file__).with_name("decode_speed.py"))
    assert machine.command_line(script, ["--batch", "16", "--out", "x.json"]) == "bench/decode_speed.py --batch 16 --out x.json"
    monkeypatch.setattr(sys, "argv", ["/anywhere/bench/decode_speed.py", "--threads", "2"])
    assert machine.command_line(script) == "bench/decode_speed.py --threads 2"  # this process's arguments
    assert machine.command_line(script, []) == "bench/decode_speed.py"  # parsed nothing: not this process's
