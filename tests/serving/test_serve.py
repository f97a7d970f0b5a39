"""`transformers serve` with kvtopo's store (serving/serve.py): concurrent chat requests over loopback."""

import json
import socket
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import GenerationConfig, PreTrainedTokenizerFast

from kvtopo.config import Config
from kvtopo.models import zoo
from kvtopo.runtime.context import active_session
from kvtopo.serving.continuous_batching import page_ownership_errors

pytest.importorskip("fastapi", reason="kvtopo serve needs transformers' server extras: pip install -e '.[serve]'")

from kvtopo.serving.serve import start_server  # noqa: E402

NEW_TOKENS = 8
EOS = 252


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The zoo Llama saved with a word-level tokenizer over its 256 ids ("w0".."w249") and a
    plain chat template: what transformers' server loads from a directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(250)} | {"<unk>": 250, "<s>": 251, "</s>": EOS}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    model = zoo.build("llama")
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=EOS, max_new_tokens=NEW_TOKENS)
    path = tmp_path_factory.mktemp("served_llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, tokenizer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chat(server, model_id: str, text: str, max_tokens: int = NEW_TOKENS) -> str:
    body = json.dumps({"model": model_id, "messages": [{"role": "user", "content": text}],
                       "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(server.url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["choices"][0]["message"]["content"]


def _prompts(lengths):
    g = torch.Generator().manual_seed(3)
    return [" ".join(f"w{i}" for i in torch.randint(0, 250, (n,), generator=g).tolist()) for n in lengths]


def _serve_concurrently(checkpoint, config: Config, lengths):
    """Serve chats of `lengths` words at once. The server's session is active for its engine, not
    in the caller's context (before, the caller's next kvtopo.generate cleared every request the
    server held), and the server stops from another thread."""
    path, _, _ = checkpoint
    server = start_server(str(path), config, port=_free_port(), dtype="float32", cb_max_batch_tokens=64)
    try:
        assert active_session() is None and server.session.active
        prompts = _prompts(lengths)
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda text: _chat(server, str(path), text), prompts))
        manager = next(m.model._cached_continuous_batching_manager
                       for m in server._serve._model_manager.loaded_models.values())
        return prompts, answers, server.session, manager.kv_cache.peak
    finally:
        stopping = threading.Thread(target=server.stop)
        stopping.start()
        stopping.join()
        assert not server.session.active


def test_concurrent_chat_requests_get_the_models_own_answers(checkpoint):
    _, model, tokenizer = checkpoint
    prompts, answers, session, peak = _serve_concurrently(checkpoint, Config.lossless(page_size=16), (20, 45, 70, 110))
    for text, answer in zip(prompts, answers):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            expected = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, ids.shape[1]:]
        assert answer == tokenizer.decode(expected, skip_special_tokens=True)
    # The histories were kvtopo's (the peak held every request's pages), and each finished
    # request gave its pages back.
    assert peak is not None and peak.fp16_bytes > 0 and len(peak.tokens) >= 2
    assert not page_ownership_errors(session)
    assert all(cache.pool.live_pages == 0 for cache in session.layers.values())


def test_the_compressed_default_serves_in_fewer_bytes(checkpoint):
    small_pages = dict(page_size=16, sink_tokens=16, recent_tokens=32)
    lengths = (180, 220, 260)
    _, lossless_answers, _, lossless = _serve_concurrently(checkpoint, Config.lossless(**small_pages), lengths)
    _, answers, _, compressed = _serve_concurrently(checkpoint, Config(**small_pages), lengths)
    assert all(len(a.split()) > 0 for a in answers + lossless_answers)
    assert compressed.ratio_vs_fp16 > 1.0
    assert compressed.total_bytes < lossless.total_bytes / 2, (compressed.total_bytes, lossless.total_bytes)


def test_the_real_model_answers_concurrent_chats_through_kvtopo():
    """`kvtopo serve smollm2` with the default compression: two chat requests at once get the
    real model's answer, both were held in kvtopo's store together, and their pages came back."""
    server = start_server("smollm2", Config(), port=_free_port(), dtype="float32", cb_max_batch_tokens=256)
    try:
        questions = ["What is the capital of France?", "Which city is the capital of France?"]
        with ThreadPoolExecutor(len(questions)) as pool:
            answers = list(pool.map(lambda text: _chat(server, server.model, text, max_tokens=16), questions))
        manager = next(m.model._cached_continuous_batching_manager
                       for m in server._serve._model_manager.loaded_models.values())
        peak = manager.kv_cache.peak
    finally:
        server.stop()
    assert all("Paris" in answer for answer in answers), answers
    assert peak is not None and len(peak.tokens) == 2 and len(peak.per_layer) == 30
    assert not page_ownership_errors(server.session)
    assert all(cache.pool.live_pages == 0 for cache in server.session.layers.values())


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # uvicorn's exit on the failed bind
def test_a_taken_port_raises_instead_of_returning_another_servers_url(checkpoint):
    """Another HTTP server on the port answers /health: start_server returned at once, its URL
    served by that other process. Now uvicorn's failed bind is an error, and the session closed."""
    import http.server

    from kvtopo.serving.serve import ServerStartError

    class Healthy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    other = http.server.HTTPServer(("127.0.0.1", 0), Healthy)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ServerStartError, match=f"could not listen at http://127.0.0.1:{other.server_port}"):
            start_server(str(checkpoint[0]), Config.lossless(), port=other.server_port, dtype="float32", timeout=60)
    finally:
        other.shutdown()
    assert active_session() is None


def test_start_server_names_a_config_of_the_wrong_type(checkpoint):
    with pytest.raises(TypeError, match="takes a kvtopo.Config, got dict"):
        start_server(str(checkpoint[0]), {"target_ratio": 8})


def test_kvtopo_serve_stops_on_ctrl_c_after_serving(checkpoint):
    """After a request, Ctrl-C stopped uvicorn but not the engine's worker thread: the process
    never exited; and a process started with SIGINT ignored never saw it. Now it stops both and
    exits 130."""
    import signal
    import subprocess
    import sys
    import time

    path, _, _ = checkpoint
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "kvtopo", "serve", str(path), "--port", str(port),
                             "--config", '{"page_size": 16}', "--dtype", "float32"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            # started with SIGINT ignored, as a shell's background job (or a test
                            # runner's worker) starts it: Python then raises no KeyboardInterrupt itself
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        server = type("Url", (), {"url": f"http://127.0.0.1:{port}"})
        deadline = time.monotonic() + 240
        while True:
            try:
                answer = _chat(server, str(path), _prompts([12])[0])
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "kvtopo serve did not come up"
                time.sleep(0.5)
        assert answer
        proc.send_signal(signal.SIGINT)
        # A hang, not a time, is what this catches: a generous wait for a loaded machine.
        try:
            stderr = proc.communicate(timeout=240)[1]
        except subprocess.TimeoutExpired:  # where it hangs: faulthandler prints every thread's stack on SIGABRT
            proc.send_signal(signal.SIGABRT)
            pytest.fail(f"kvtopo serve did not exit after Ctrl-C; its threads:\n{proc.communicate(timeout=60)[1][-8000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr[-2000:]
    assert "kvtopo serve: stopped" in stderr


def test_stop_gives_up_on_an_engine_that_does_not_stop_and_closes_the_session(capsys):
    """transformers' `kill_server` joins the engine's worker with no time limit: a worker that never
    stops held `kvtopo serve` after Ctrl-C. `stop` waits its timeout, says so and closes the session."""
    import contextvars

    from kvtopo.runtime.session import Session
    from kvtopo.serving.serve import KvtopoServer

    never = threading.Event()
    serve = type("Serve", (), {"server": type("Uvicorn", (), {"should_exit": False})(),
                               "kill_server": lambda self: never.wait()})()
    context = contextvars.copy_context()
    session = Session(Config.lossless())
    context.run(session.__enter__)
    server = KvtopoServer("http://127.0.0.1:1", "m", session, serve, context)
    server.stop(timeout=0.2)
    never.set()
    assert serve.server.should_exit and not session.active
    assert "the engine did not stop within 0.2 s; closing the session anyway" in capsys.readouterr().err
