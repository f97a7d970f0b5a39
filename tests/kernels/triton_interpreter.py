"""The Triton interpreter for the kernel tests on CPU, set up in one place for every Triton test
module: import this before anything that imports triton.

The interpreter must be on before triton.language is imported (its standard functions are
@triton.jit'd at import). When another test module already imported triton without it (e.g.
through torch._inductor), a module's tests run again in a fresh subprocess instead: `in_process`
skips them here, and the test that `fresh_interpreter_run(__file__)` makes runs them there."""

import os
import subprocess
import sys

import pytest

PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not PREIMPORTED:
    os.environ["TRITON_INTERPRET"] = "1"

in_process = pytest.mark.skipif(PREIMPORTED, reason="triton was imported without the interpreter: "
                                "covered by the module's test_in_fresh_interpreter_process")


def fresh_interpreter_run(module_file: str):
    """A test that runs `module_file`'s tests in a fresh interpreter process, where this one
    imported triton without the interpreter."""

    @pytest.mark.skipif(not PREIMPORTED, reason="this process already runs the interpreter")
    def test_in_fresh_interpreter_process():
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module_file],
                             env=env, capture_output=True, text=True, timeout=900,
                             cwd=os.path.dirname(os.path.abspath(module_file)))
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
        assert " passed" in run.stdout and "skipped" in run.stdout  # the real tests ran there

    return test_in_fresh_interpreter_process
