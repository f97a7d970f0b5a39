"""`kvtopo export --target`: the export is compiled for the runtime and smoke-run against the
PyTorch session; a target that does not run the format is a usage error."""

import pytest

from kvtopo.cli import main
from kvtopo.models import zoo


def test_target_must_run_the_format(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "mlir", "llama", "--out", str(tmp_path), "--target", "openvino"])
    assert exit_info.value.code == 2
    assert "--target openvino runs onnx exports, not mlir" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before exporting anything


# -- MODEL as a path or the real model's name ---------------------------------------------------
def _usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("files, model, message", [
    ({}, "absent", "no such file or directory"),
    ({}, ".", "a directory without config.json is not a Hugging Face checkpoint"),
    ({"config.json": b"{}"}, ".", "has config.json but no weights"),
    ({"model.gguf": b"PK\x03\x04 a zip"}, "model.gguf", "starts with b'PK\\x03\\x04'"),
    ({"weights.bin": b"GGUF"}, "weights.bin", "a file must be a GGUF model"),
], ids=["missing", "no-config", "no-weights", "not-gguf-content", "not-gguf-name"])
def test_model_path_that_is_neither_checkpoint_nor_gguf_is_named(tmp_path, capsys, files, model, message):
    src = tmp_path / "src"
    src.mkdir()
    for name, data in files.items():
        (src / name).write_bytes(data)
    path = src / model
    out = tmp_path / "out"
    err = _usage_error(["export", "onnx", str(path), "--out", str(out)], capsys)
    assert f"model path {path}: " in err and message in err, err
    assert not out.exists()


def test_unknown_model_name_lists_the_choices(tmp_path, capsys):
    err = _usage_error(["export", "onnx", "gpt5", "--out", str(tmp_path)], capsys)
    assert "unknown model 'gpt5'" in err and "llama" in err and "smollm2" in err, err


@pytest.mark.parametrize("extra, message", [
    (["--config", "[1, 2]"], "--config: expected a JSON object of Config fields, got a list"),
    (["--config", '{"policy": "snapkv"}'], "--config: export supports policies ('topo', 'full', 'kivi'), not 'snapkv'"),
], ids=["config-not-an-object", "policy-not-exported"])
def test_config_the_export_cannot_take_is_refused_before_loading(tmp_path, capsys, monkeypatch, extra, message):
    monkeypatch.setattr("kvtopo.export_cli.load_model", lambda spec: pytest.fail("loaded the model"))
    out = tmp_path / "out"
    err = _usage_error(["export", "onnx", "llama", "--out", str(out), *extra], capsys)
    assert message in err, err
    assert not out.exists()


@pytest.mark.parametrize("out, message", [
    ("", "--out is empty"),
    ("file", "--out {tmp}/file is not a directory"),
    ("file/sub", "--out {tmp}/file/sub: {tmp}/file is not a directory"),
    ("/proc", "--out /proc is not writable ("),  # Linux's /proc: no file can be created in it, even by root
    ("/proc/kvtopo/out", "--out /proc/kvtopo/out: /proc is not writable ("),
], ids=["empty", "a-file", "under-a-file", "unwritable", "under-unwritable"])
def test_out_that_cannot_be_a_directory_is_refused_before_loading(tmp_path, capsys, monkeypatch, out, message):
    monkeypatch.setattr("kvtopo.export_cli.load_model", lambda spec: pytest.fail("loaded the model"))
    (tmp_path / "file").write_text("")
    err = _usage_error(["export", "mlir", "llama", "--out", str(tmp_path / out) if out else ""], capsys)
    assert message.format(tmp=tmp_path) in err, err


@pytest.mark.parametrize("build, message", [
    (zoo.lfm2_hybrid, "keeps state outside attention"),
    (lambda: zoo.build("mistral-sw"), "export does not carry sliding windows"),
], ids=["hybrid", "sliding-window"])
def test_model_the_export_refuses_is_named_without_a_traceback(tmp_path, capsys, build, message):
    """A refused checkpoint exits 2 with the export's reason, and leaves no output directory."""
    checkpoint, out = tmp_path / "checkpoint", tmp_path / "out"
    build().save_pretrained(checkpoint)
    err = _usage_error(["export", "onnx", str(checkpoint), "--out", str(out)], capsys)
    assert f"{checkpoint}: " in err and message in err, err
    assert not out.exists()


def test_checkpoint_directory_exports_and_openvino_smoke_runs(tmp_path, capsys):
    """A Hugging Face checkpoint directory (save_pretrained of the zoo Llama) loads, exports and,
    with --target openvino, gives the PyTorch session's tokens; the reference is the model loaded
    from the directory. (One export for both checks: the zoo name would export the same graph;
    the onnxruntime target is smoke-run by the GGUF case below and test_npu_profile's CLI case.)"""
    checkpoint = tmp_path / "checkpoint"
    zoo.build("llama").save_pretrained(checkpoint)
    code = main(["export", "onnx", str(checkpoint), "--out", str(tmp_path / "out"), "--max-context", "64",
                 "--target", "openvino", "--smoke-tokens", "4"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "openvino: same tokens as the PyTorch session over 4 new tokens" in out
    # Config()'s first Mid page needs 321 tokens: the default prompt stops at 64 - 4, and says so.
    assert "note: the smoke run's 60 + 4 tokens reached no Mid page (this config needs more than --max-context" in out
    assert (tmp_path / "out" / "decode_step.onnx").is_file() and (tmp_path / "out" / "compressor.onnx").is_file()


def test_default_smoke_prompt_reaches_mid(tmp_path, capsys, monkeypatch):
    """Without --smoke-prompt the smoke run's prompt is long enough for a Mid page under --config
    (8-token pages, 8 sink and 16 Recent tokens: 33), so the compressor ran (it codes the tokens a
    Mid page keeps; a budget that keeps none would skip it)."""
    from kvtopo.export import check

    runs = []
    compare = check.compare_with_session
    monkeypatch.setattr(check, "compare_with_session", lambda *args: runs.append(compare(*args)) or runs[-1])
    code = main(["export", "onnx", "llama", "--out", str(tmp_path), "--max-context", "40", "--target", "onnxruntime",
                 "--config", '{"page_size": 8, "sink_tokens": 8, "recent_tokens": 16, "target_ratio": 2}',
                 "--smoke-tokens", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "same tokens" in out and "note:" not in out, out
    (agreement,) = runs[0]
    assert len(agreement.tokens) == 33 + 2
    kept = [page.kept for layer in agreement.runner.layers for page in layer.pages if page.phase.value == "mid"]
    assert kept and all(k > 0 for k in kept), kept


@pytest.mark.parametrize("extra", [["--smoke-tokens", "4"], ["--smoke-prompt", "16"], ["--max-logit-error", "0.5"]])
def test_smoke_options_need_target(tmp_path, capsys, monkeypatch, extra):
    monkeypatch.setattr("kvtopo.export_cli.load_model", lambda spec: pytest.fail("loaded the model"))
    err = _usage_error(["export", "onnx", "llama", "--out", str(tmp_path / "out"), *extra], capsys)
    assert f"{extra[0]} without --target" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bound", ["0", "-1", "nan"])
def test_a_logit_bound_that_accepts_nothing_is_refused(tmp_path, capsys, monkeypatch, bound):
    monkeypatch.setattr("kvtopo.export_cli.load_model", lambda spec: pytest.fail("loaded the model"))
    err = _usage_error(["export", "onnx", "llama", "--out", str(tmp_path / "out"), "--target", "onnxruntime",
                        "--max-logit-error", bound], capsys)
    assert f"--max-logit-error {float(bound)} is invalid" in err, err


def _write_tiny_gguf(path, vocab=300, hidden=64, ffn=128, layers=2, heads=4, kv_heads=2) -> dict:
    """A 2-layer Llama as a GGUF file (float32 tensors, a byte-level tokenizer: 256 byte tokens and
    special ones, no merges), as llama.cpp's `gguf` package writes it; returns its tensors."""
    import numpy as np
    from gguf import GGUFWriter
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(0)
    head_dim = hidden // heads
    writer = GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    specials = ["<|endoftext|>"] + [f"<extra_{i}>" for i in range(vocab - 257)]
    writer.add_tokenizer_model("gpt2")
    byte_token = bytes_to_unicode()
    writer.add_token_list([byte_token[b] for b in range(256)] + specials)  # a byte's id is its value
    writer.add_token_types([1] * 256 + [3] * len(specials))
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_merges([])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(256)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                       f"blk.{i}.attn_q.weight": (heads * head_dim, hidden),
                       f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
                       f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden),
                       f"blk.{i}.attn_output.weight": (hidden, heads * head_dim),
                       f"blk.{i}.ffn_gate.weight": (ffn, hidden), f"blk.{i}.ffn_up.weight": (ffn, hidden),
                       f"blk.{i}.ffn_down.weight": (hidden, ffn)})
    tensors = {name: (rng.standard_normal(shape) * (1.0 if len(shape) == 1 else 0.1)).astype(np.float32)
               for name, shape in shapes.items()}
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def test_gguf_file_exports_and_runs(tmp_path, capsys):
    """A .gguf path loads through transformers' gguf_file= (the file's own weights and tokenizer),
    exports, and the smoke run on prose gives the PyTorch session's tokens."""
    import numpy as np

    from kvtopo.models import pretrained

    gguf = tmp_path / "tiny.gguf"
    tensors = _write_tiny_gguf(gguf)
    model, tokenizer = pretrained.load_checkpoint(gguf)
    np.testing.assert_array_equal(model.model.embed_tokens.weight.detach().numpy(), tensors["token_embd.weight"])
    assert tokenizer("Hi").input_ids == [ord("H"), ord("i")]
    code = main(["export", "onnx", str(gguf), "--out", str(tmp_path / "out"), "--max-context", "96",
                 "--target", "onnxruntime", "--smoke-prompt", "64", "--smoke-tokens", "8"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "onnxruntime: same tokens as the PyTorch session over 8 new tokens" in out
