"""`transformers serve` with kvtopo's store as its KV cache: an OpenAI-compatible server.

    kvtopo serve PATH [--config '{"target_ratio": 8}'] [--host 127.0.0.1] [--port 8000]
    kvtopo serve smollm2                  # the project's real model (models/pretrained.py)

    server = start_server("path/to/checkpoint", Config(), port=8000)   # returns once it listens
    ...                                    # POST http://127.0.0.1:8000/v1/chat/completions
    server.session.stats()                 # the bytes every request's history holds
    server.stop()

transformers' own server runs unchanged (its FastAPI app, chat template, streaming, request
handling) with its continuous batching on; every request's KV history lives in one kvtopo
session through `serving.continuous_batching.KvtopoBatchingManager`. The hook is the engine's own
entry point: the server asks the loaded model for `model.init_continuous_batching(...)`, and
kvtopo gives each model it loads an `init_continuous_batching` that builds (once) kvtopo's manager
with the server's generation and batching configs. To reach the model as it loads, the server's
`ModelManager` is built as a subclass whose `_load_model` adds that method: the server builds its
manager by the module-level name, which is rebound to the subclass while the server is built (the
same kind of patch as the cache class in continuous_batching.py, pinned to the same transformers
version). Needs the packages transformers' server needs: fastapi, uvicorn, pydantic, openai
(`pip install -e '.[serve]'`).
"""

from __future__ import annotations

import contextvars
import functools
import signal
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from kvtopo.config import Config
from kvtopo.runtime.session import Session

from .continuous_batching import KvtopoBatchingManager, check_transformers_version

_MANAGER_CLASS_LOCK = threading.Lock()


def _kvtopo_batching(model, session: Session, generation_config=None, continuous_batching_config=None,
                     workload_hints=None) -> KvtopoBatchingManager:
    """`model.init_continuous_batching` of a served model: kvtopo's manager, built on first use
    (as transformers caches its own manager on the model) and reused by every request."""
    manager = getattr(model, "_cached_continuous_batching_manager", None)
    if not isinstance(manager, KvtopoBatchingManager):
        manager = KvtopoBatchingManager(model, session, generation_config, continuous_batching_config, workload_hints)
        model._cached_continuous_batching_manager = manager
    return manager


@contextmanager
def _server_loads_models_with(session: Session):
    """While the block runs, transformers' server builds a ModelManager whose models carry kvtopo's
    `init_continuous_batching`."""
    from transformers.cli.serving import model_manager

    class KvtopoModelManager(model_manager.ModelManager):
        def _load_model(self, model_id_and_revision, tqdm_class=None, progress_callback=None, gguf_file=None):
            if gguf_file is None:
                model = super()._load_model(model_id_and_revision, tqdm_class, progress_callback)
            else:  # the server picks the class by config.architectures, which a GGUF file's config lacks
                from transformers import AutoModelForCausalLM

                model_id, revision = model_manager.split_revision(model_id_and_revision)
                model = AutoModelForCausalLM.from_pretrained(model_id, gguf_file=gguf_file, revision=revision,
                                                             dtype=self.dtype, device_map=self.device)
            model.init_continuous_batching = functools.partial(_kvtopo_batching, model, session)
            return model

    with _MANAGER_CLASS_LOCK:
        original = model_manager.ModelManager
        model_manager.ModelManager = KvtopoModelManager
        try:
            yield
        finally:
            model_manager.ModelManager = original


STOP_TIMEOUT_S = 30.0  # how long `KvtopoServer.stop` waits for transformers' server and engine to stop


@dataclass
class KvtopoServer:
    """A running server: its URL, the model id requests name (what transformers' server loaded:
    for `smollm2`, the cached GGUF file), the kvtopo session holding every request's history,
    and `stop`."""

    url: str
    model: str
    session: Session
    _serve: object
    _context: contextvars.Context  # where the session is active: the caller's own context is left alone

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop serving and close the session (from any thread). transformers' `kill_server`
        joins the engine's worker with no time limit; it gets `timeout` seconds, then it is left
        (a warning says so) and the session is closed anyway."""
        # Told directly: kill_server skips it when the thread looks stopped, as it does on Python
        # 3.11 after a join() interrupted by Ctrl-C (the interrupted wait marks it stopped).
        self._serve.server.should_exit = True
        stopping = threading.Thread(target=self._serve.kill_server, name="kvtopo-serve-stop", daemon=True)
        stopping.start()
        stopping.join(timeout)
        if stopping.is_alive():
            print(f"kvtopo serve: the engine did not stop within {timeout:g} s; closing the session anyway",
                  file=sys.stderr)
        if self.session.active:
            self._context.run(self.session.__exit__, None, None, None)


def _model_spec(model: str) -> str:
    """What transformers' server loads: a checkpoint directory or `<dir>:<file>.gguf` as it is;
    `smollm2` is the project's real model, fetched and cached (models/pretrained.py). Nothing is
    looked up on a model hub."""
    if model != "smollm2":
        directory, _, gguf = model.rpartition(":") if model.endswith(".gguf") else (model, "", "")
        if not Path(directory).is_dir() or (gguf and not (Path(directory) / gguf).is_file()):
            raise FileNotFoundError(f"model {model!r} is not a checkpoint directory or <dir>:<file>.gguf here "
                                    "(kvtopo serves local models only; or name smollm2)")
        if not gguf and not (Path(directory) / "config.json").is_file():
            raise FileNotFoundError(f"model {model!r} is a directory without a config.json: not a transformers "
                                    "checkpoint (save one with model.save_pretrained, or name <dir>:<file>.gguf)")
        return model
    from kvtopo.models import pretrained

    path = pretrained.weights_path()
    return f"{path.parent}:{path.name}"


class ServerStartError(RuntimeError):
    """transformers' server stopped before it listened (e.g. its address was in use)."""


def start_server(model: str, config: Config | None = None, *, host: str = "127.0.0.1", port: int = 8000,
                 block: bool = False, timeout: float = 300.0, **serve_options) -> KvtopoServer:
    """Start transformers' OpenAI-compatible server on `model` (a checkpoint directory, a
    `<dir>:<file>.gguf`, or `smollm2`) with kvtopo `config` (default `Config()`) as the KV cache.

    `block=False` returns once the server answers /health (within `timeout` seconds, the model
    loaded); `block=True` serves until interrupted (Ctrl-C or SIGTERM), then stops the engine and
    closes the session. Raises `ServerStartError` if the server cannot listen (a taken port), so a
    caller never gets another server's URL. `serve_options`: other `transformers serve` options
    (e.g. `cb_max_batch_tokens=256`, `dtype="float32"`)."""
    check_transformers_version()
    from transformers.cli.serve import Serve
    from transformers.utils.import_utils import is_serve_available

    session = Session(config)  # checks config before a model is fetched
    if not is_serve_available():
        raise ImportError("kvtopo serve runs transformers' server, which needs fastapi, uvicorn, pydantic and openai: "
                          "pip install -e '.[serve]'")
    spec, url = _model_spec(model), f"http://{host}:{port}"
    if block:
        print(f"kvtopo serve: {url}/v1/chat/completions; requests name the model {spec!r}", file=sys.stderr)
    # From the start: a signal before the server is up stops it too (the session is closed)
    with _sigterm_interrupts() if block else nullcontext():
        # The session is active in a context of its own (the engine's worker checks it is open): entered
        # in the caller's, it stayed the caller's active session, and the caller's next kvtopo.generate
        # cleared every request the server held.
        context = contextvars.copy_context()
        context.run(session.__enter__)
        try:
            with _server_loads_models_with(session):
                # Always in uvicorn's own thread: run in this one (transformers' blocking mode), an
                # interrupt stopped uvicorn but not the engine's worker thread, and the process hung.
                serve = Serve(force_model=spec, continuous_batching=True, device="cpu", host=host,
                              port=port, non_blocking=True, **serve_options)
        except BaseException:
            context.run(session.__exit__, None, None, None)
            raise
        server = KvtopoServer(url, spec, session, serve, context)
        try:
            _wait_until_up(server, None if block else timeout)
            if block:
                while serve._thread.is_alive():  # until Ctrl-C (KeyboardInterrupt here) or the server exits
                    time.sleep(0.2)  # not join(): see stop()
        except BaseException:
            server.stop()
            raise
        if block:
            server.stop()
        return server


@contextmanager
def _sigterm_interrupts():
    """SIGTERM and SIGINT stop a blocking server as Ctrl-C does (uvicorn, off the main thread, no
    longer handles signals itself)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    # SIGINT too: a process started with it ignored (a background job of a shell script, some
    # test runners' workers) inherits SIG_IGN, and Python then raises no KeyboardInterrupt for it.
    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _wait_until_up(server: KvtopoServer, timeout: float | None) -> None:
    """Until uvicorn listens and the app answers /health. Listening is judged by uvicorn's own
    flag, not by /health alone: on a taken port another server answers it. The caller stops the
    server if this raises."""
    import urllib.request

    deadline = None if timeout is None else time.monotonic() + timeout
    listening = server._serve.server
    while True:
        if not listening.started and not server._serve._thread.is_alive():
            raise ServerStartError(f"the kvtopo server could not listen at {server.url} (its log above says why, "
                                   "e.g. the address is already in use)")
        if listening.started:
            try:
                with urllib.request.urlopen(server.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"the kvtopo server at {server.url} did not answer /health within {timeout:.0f} s")
        time.sleep(0.2)
