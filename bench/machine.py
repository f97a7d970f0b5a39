"""The machine a bench ran on and the command that ran it, written into its results.

Vector kernels and bfloat16 products differ by CPU: a CPU with AVX512-BF16 instructions gives other
bfloat16 logits than one without (oneDNN picks its kernels by what the CPU has, unless
ONEDNN_MAX_CPU_ISA caps it), and AVX-512 changes the decode kernel's speed. A figure is comparable
only with figures from the same kind of machine, so every bench records this beside its figures,
and the command that repeats them (`command_line`).
"""
from __future__ import annotations

import os
import platform
import sys

import torch

# The instruction sets that change a figure here: the decode kernel's vector width, oneDNN's
# bfloat16 and int8 products.
_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def _cpuinfo() -> tuple[str | None, set[str]]:
    """The CPU's model name and flags from /proc/cpuinfo (Linux); (None, empty) elsewhere."""
    try:
        text = open("/proc/cpuinfo", encoding="utf-8").read()
    except OSError:
        return None, set()
    model, flags = None, set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model, flags


def command_line(script: str, argv: list[str] | None = None) -> str:
    """The command that repeats a bench's run, as the docs quote it: `bench/NAME ARGS` (`argv`: the
    arguments its main() parsed; None: this process's)."""
    return " ".join([f"bench/{os.path.basename(script)}", *(sys.argv[1:] if argv is None else argv)])


def describe_machine() -> dict:
    model, flags = _cpuinfo()
    return {
        "cpu": model or platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "cpu_flags": [f for f in _FLAGS if f in flags],
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


if __name__ == "__main__":
    import json

    print(json.dumps(describe_machine(), indent=2))
