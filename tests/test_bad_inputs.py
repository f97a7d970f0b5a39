"""Bad input gets a clear error before any compute: each message names the argument, the bad
value and what is allowed. For kvtopo.generate, no forward runs (the model is wrapped in a
module counting its calls, and the session counts attention calls); for the export entry
points, nothing is written."""

import dataclasses

import pytest
import torch

import kvtopo
from kvtopo.compiled import compiled_backend
from kvtopo.models import zoo

from forward_counting import Counting

try:
    from kvtopo import export as kx
except ImportError:  # running from the source tree without the package installed
    import export as kx

VOCAB = 256
NAN, INF = float("nan"), float("inf")


# -- Config --------------------------------------------------------------------------------------
CONFIG_CASES = [
    ("mid_bits", 4.0, r"Config\.mid_bits=4\.0 is invalid: None or an int in \(2, 4, 8\)"),
    ("mid_bits", True, r"Config\.mid_bits=True is invalid"),
    ("mid_bits", 3, r"Config\.mid_bits=3 is invalid"),
    ("recent_bits", 8.0, r"Config\.recent_bits=8\.0 is invalid: None or an int in"),
    ("page_size", True, r"Config\.page_size=True is invalid: an int in \[1, 4096\]"),
    ("page_size", 32.0, r"Config\.page_size=32\.0 is invalid"),
    ("page_size", 8192, r"Config\.page_size=8192 is invalid"),
    ("sink_tokens", -1, r"Config\.sink_tokens=-1 is invalid: an int >= 0"),
    ("sink_tokens", False, r"Config\.sink_tokens=False is invalid"),
    ("recent_tokens", 64.0, r"Config\.recent_tokens=64\.0 is invalid: an int >= 0"),
    ("observation_window", 0, r"Config\.observation_window=0 is invalid: an int >= 1"),
    ("observation_window", True, r"Config\.observation_window=True is invalid"),
    ("refit_after", 0, r"Config\.refit_after=0 is invalid: None or an int >= 1"),
    ("refit_after", 2048.0, r"Config\.refit_after=2048\.0 is invalid"),
    ("layer_budget_bytes", 1e6, r"Config\.layer_budget_bytes=1000000\.0 is invalid: None or an int >= 1"),
    ("max_pages", True, r"Config\.max_pages=True is invalid: None or an int >= 1"),
    ("prefill_chunk_size", 0, r"Config\.prefill_chunk_size=0 is invalid: an int >= 1"),
    ("prefill_chunk_size", 512.0, r"Config\.prefill_chunk_size=512\.0 is invalid"),
    ("target_ratio", INF, r"Config\.target_ratio=inf is invalid: None or a finite number >= 1"),
    ("target_ratio", NAN, r"Config\.target_ratio=nan is invalid"),
    ("target_ratio", -8.0, r"Config\.target_ratio=-8\.0 is invalid"),
    ("target_ratio", 0.5, r"Config\.target_ratio=0\.5 is invalid"),
    ("target_ratio", True, r"Config\.target_ratio=True is invalid"),
    ("target_ratio", "8", r"Config\.target_ratio='8' is invalid"),
    ("score_margin", INF, r"Config\.score_margin=inf is invalid: a finite number > 0"),
    ("score_margin", NAN, r"Config\.score_margin=nan is invalid"),
    ("score_margin", 0, r"Config\.score_margin=0 is invalid"),
    ("score_margin", True, r"Config\.score_margin=True is invalid"),
    ("key_energy", NAN, r"Config\.key_energy=nan is invalid: None or a float in \(0, 1\]"),
    ("value_energy", NAN, r"Config\.value_energy=nan is invalid"),
    ("key_energy", 0.0, r"Config\.key_energy=0\.0 is invalid"),
    ("value_energy", 1.5, r"Config\.value_energy=1\.5 is invalid"),
    ("key_energy", True, r"Config\.key_energy=True is invalid"),
    ("protected_spans", ((0, 4.0),), r"Config\.protected_spans=\(\(0, 4\.0\),\) is invalid: a tuple of \(start, end\)"),
    ("protected_spans", ((4, 4),), r"Config\.protected_spans=\(\(4, 4\),\) is invalid"),
    ("protected_spans", ((-1, 4),), r"Config\.protected_spans=\(\(-1, 4\),\) is invalid"),
    ("protected_spans", ((0, 4, 8),), r"Config\.protected_spans=\(\(0, 4, 8\),\) is invalid"),
    ("protected_spans", [(0, 4)], r"Config\.protected_spans=\[\(0, 4\)\] is invalid"),
    ("protected_spans", ((True, 4),), r"Config\.protected_spans=\(\(True, 4\),\) is invalid"),
    ("policy", ["topo"], r"Config\.policy=\['topo'\] is invalid: one of \("),
    ("over_budget", "drop", r"Config\.over_budget='drop' is invalid: one of \('evict', 'raise'\)"),
    ("eviction_scope", None, r"Config\.eviction_scope=None is invalid: one of \('append', 'page'\)"),
]


@pytest.mark.parametrize("field,value,message", CONFIG_CASES, ids=[f"{c[0]}={c[1]!r}" for c in CONFIG_CASES])
def test_bad_config_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        kvtopo.Config(**{field: value})


def test_full_policy_names_the_budget_field_it_refuses():
    with pytest.raises(ValueError, match=r"Config\.layer_budget_bytes=4096 is invalid: None with policy 'full'"):
        kvtopo.Config.lossless(layer_budget_bytes=4096)


def test_valid_configs_still_construct():
    """Validation refuses nothing valid, and keeps what it was given."""
    assert kvtopo.Config().policy == "topo"
    assert kvtopo.Config.lossless().policy == "full"
    fields = dict(mid_bits=None, recent_bits=2, key_energy=1, value_energy=1, target_ratio=2, score_margin=1,
                  protected_spans=((0, 16), (40, 48)), layer_budget_bytes=4096, max_pages=64)
    config = kvtopo.Config(**fields)
    assert {name: getattr(config, name) for name in fields} == fields


def test_numpy_numbers_are_taken_as_python_ones():
    """A setting read from a numpy array is a number like any other: taken, stored as Python's own
    (a numpy int was refused as "an int", and a numpy float kept would not serialise to JSON)."""
    import json

    import numpy as np

    config = kvtopo.Config(page_size=np.int64(16), mid_bits=np.int32(2), target_ratio=np.float32(4.0),
                           protected_spans=((np.int64(0), np.int64(16)),))
    assert (config.page_size, config.mid_bits, config.target_ratio, config.protected_spans) == (16, 2, 4.0, ((0, 16),))
    assert {type(v) for v in (config.page_size, config.mid_bits, config.protected_spans[0][0])} == {int}
    assert type(config.target_ratio) is float
    json.dumps(dataclasses.asdict(config))
    with pytest.raises(ValueError, match=r"Config\.mid_bits=np\.True_ is invalid"):
        kvtopo.Config(mid_bits=np.bool_(True))


# -- generate ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compiled():
    return kvtopo.compile(zoo.build("llama"), inductor=False)


IDS = torch.arange(10, 16)[None]  # [1, 6]
LEFT_PAD_MASK = torch.tensor([[0, 0, 1, 1, 1, 1]])

GENERATE_CASES = [
    # (id, kwargs for kvtopo.generate, exception, message)
    ("ids-not-a-tensor", dict(input_ids=[[1, 2, 3]]), TypeError, r"input_ids is a list; allowed: a \[batch, tokens\] integer tensor"),
    ("ids-float", dict(input_ids=IDS.float()), ValueError, r"input_ids is a torch\.float32 tensor of shape \(1, 6\); allowed: a \[batch, tokens\] torch\.long"),
    ("ids-1d", dict(input_ids=IDS[0]), ValueError, r"input_ids is a torch\.int64 tensor of shape \(6,\)"),
    ("ids-empty-prompt", dict(input_ids=IDS[:, :0]), ValueError, r"input_ids is an empty prompt \(shape \(1, 0\)\); allowed: at least one token"),
    ("ids-batch-0", dict(input_ids=IDS[:0]), ValueError, r"input_ids has batch 0 \(shape \(0, 6\)\); allowed: at least one sequence"),
    ("ids-out-of-vocab", dict(input_ids=torch.tensor([[1, 2, 3, VOCAB, 5]])), ValueError, r"input_ids holds 256 at \[0, 3\]; allowed: ids in \[0, 256\) \(the model's vocabulary\)"),
    ("ids-negative", dict(input_ids=torch.tensor([[1, -3, 2]])), ValueError, r"input_ids holds -3 at \[0, 1\]; allowed: ids in \[0, 256\)"),
    ("max_new_tokens-0", dict(max_new_tokens=0), ValueError, r"max_new_tokens=0 is invalid: an int >= 1"),
    ("max_new_tokens-neg", dict(max_new_tokens=-2), ValueError, r"max_new_tokens=-2 is invalid: an int >= 1"),
    ("max_new_tokens-float", dict(max_new_tokens=4.0), ValueError, r"max_new_tokens=4\.0 is invalid: an int >= 1"),
    ("max_new_tokens-bool", dict(max_new_tokens=True), ValueError, r"max_new_tokens=True is invalid"),
    ("chunk-0", dict(prefill_chunk_size=0), ValueError, r"prefill_chunk_size=0 is invalid: None \(the config's\) or an int >= 1"),
    ("chunk-neg", dict(prefill_chunk_size=-8), ValueError, r"prefill_chunk_size=-8 is invalid"),
    ("chunk-float", dict(prefill_chunk_size=16.0), ValueError, r"prefill_chunk_size=16\.0 is invalid"),
    ("chunk-bool", dict(prefill_chunk_size=True), ValueError, r"prefill_chunk_size=True is invalid"),
    ("top_k-neg-1", dict(do_sample=True, top_k=-1), ValueError,
     r"top_k=-1 is invalid: None or 0 \(no top-k filtering, as in HF\) or an int >= 1"),
    ("top_k-neg-greedy", dict(top_k=-1), ValueError, r"top_k=-1 is invalid"),
    ("top_k-neg", dict(do_sample=True, top_k=-5), ValueError, r"top_k=-5 is invalid"),
    ("top_k-float", dict(do_sample=True, top_k=5.0), ValueError, r"top_k=5\.0 is invalid"),
    ("top_k-bool", dict(do_sample=True, top_k=True), ValueError, r"top_k=True is invalid"),
    ("top_p-0", dict(do_sample=True, top_p=0.0), ValueError, r"top_p=0\.0 is invalid: None \(no nucleus filtering\) or a number in \(0, 1\]"),
    ("top_p-above-1", dict(do_sample=True, top_p=1.5), ValueError, r"top_p=1\.5 is invalid"),
    ("top_p-above-1-greedy", dict(top_p=1.5), ValueError, r"top_p=1\.5 is invalid"),
    ("top_p-nan", dict(do_sample=True, top_p=NAN), ValueError, r"top_p=nan is invalid"),
    ("top_p-neg", dict(do_sample=True, top_p=-0.1), ValueError, r"top_p=-0\.1 is invalid"),
    ("temperature-0-sampling", dict(do_sample=True, temperature=0.0), ValueError, r"temperature=0\.0 is invalid: a finite number > 0 when do_sample=True"),
    ("temperature-neg", dict(temperature=-1.0), ValueError, r"temperature=-1\.0 is invalid: a finite number > 0"),
    ("temperature-nan", dict(temperature=NAN), ValueError, r"temperature=nan is invalid"),
    ("temperature-inf", dict(do_sample=True, temperature=INF), ValueError, r"temperature=inf is invalid"),
    ("temperature-str", dict(temperature="0.7"), ValueError, r"temperature='0\.7' is invalid"),
    ("do_sample-str", dict(do_sample="yes"), ValueError, r"do_sample='yes' is invalid: a bool"),
    ("generator", dict(do_sample=True, generator=7), TypeError, r"generator=7 is invalid: None or a torch\.Generator"),
    ("progress", dict(progress="yes"), ValueError, r"progress='yes' is invalid: None or a bool"),
    ("return_logits", dict(return_logits=1), ValueError, r"return_logits=1 is invalid: a bool"),
    ("config-dict", dict(config={"page_size": 16}), TypeError, r"config=\{'page_size': 16\} is invalid: None or a kvtopo\.Config"),
    ("mask-shape", dict(attention_mask=torch.ones(1, 5, dtype=torch.long)), ValueError, r"attention_mask shape \(1, 5\) != input_ids shape \(1, 6\)"),
    ("mask-float", dict(attention_mask=torch.ones(1, 6)), ValueError, r"attention_mask is a torch\.float32 tensor of shape \(1, 6\); allowed: a bool or integer \(0/1\)"),
    ("mask-value", dict(attention_mask=torch.tensor([[1, 1, 2, 1, 1, 1]])), ValueError, r"attention_mask holds the value 2; allowed: 0 \(padding\) and 1"),
    ("mask-list", dict(attention_mask=[[1] * 6]), TypeError, r"attention_mask is a list"),
    ("mask-right-padded", dict(attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0]])), ValueError, r"attention_mask must be left-padded"),
    ("eos-negative", dict(eos_token_id=-1), ValueError, r"eos_token_id=-1 is invalid: None, an int or a non-empty list of ints: ids in \[0, 256\)"),
    ("eos-out-of-vocab", dict(eos_token_id=[3, 256]), ValueError, r"eos_token_id=\[3, 256\] is invalid"),
    ("eos-empty-list", dict(eos_token_id=[]), ValueError, r"eos_token_id=\[\] is invalid"),
    ("eos-float", dict(eos_token_id=2.0), ValueError, r"eos_token_id=2\.0 is invalid"),
    ("eos-str", dict(eos_token_id="2"), ValueError, r"eos_token_id='2' is invalid"),
    ("eos-float-tensor", dict(eos_token_id=torch.tensor([2.0])), ValueError, r"eos_token_id is a torch\.float32 tensor"),
    ("pad-negative", dict(eos_token_id=2, pad_token_id=-1), ValueError, r"pad_token_id=-1 is invalid: None or an int: ids in \[0, 256\)"),
    ("pad-list", dict(eos_token_id=2, pad_token_id=[0]), ValueError, r"pad_token_id=\[0\] is invalid"),
    ("pad-without-eos", dict(pad_token_id=300), ValueError, r"pad_token_id=300 is invalid"),
]


@pytest.mark.parametrize("overrides,error,message", [c[1:] for c in GENERATE_CASES], ids=[c[0] for c in GENERATE_CASES])
def test_bad_generate_argument_raises_before_any_forward(compiled, overrides, error, message):
    model = Counting(compiled)
    with kvtopo.session(kvtopo.Config.lossless()) as s:
        with pytest.raises(error, match=message):
            kvtopo.generate(model, **{"input_ids": IDS, "max_new_tokens": 2, **overrides})
        assert s.calls == 0
    assert model.calls == 0


def test_the_same_wrapper_does_run_with_good_arguments(compiled):
    """The counters of the test above do count: a good call runs forwards and attention."""
    model = Counting(compiled)
    with kvtopo.session(kvtopo.Config.lossless()) as s:
        out = kvtopo.generate(model, IDS, 2, attention_mask=LEFT_PAD_MASK, eos_token_id=torch.tensor([200]),
                              pad_token_id=0, top_k=5, top_p=1.0, temperature=0.0)  # greedy: temperature 0 is ignored
        assert s.calls > 0
    new = out.shape[1] - IDS.shape[1]
    assert new == 2 or out[0, -1] == 200
    assert model.calls == new  # the prefill (one chunk) gives the first token, each further one a decode step


@pytest.mark.parametrize("field,value,message", [
    ("eos_token_id", 999, r"eos_token_id=999 \(from model\.generation_config\) is invalid: None, an int or a non-empty "
                          r"list of ints: ids in \[0, 256\)"),
    ("eos_token_id", [1, -2], r"eos_token_id=\[1, -2\] \(from model\.generation_config\) is invalid"),
    ("pad_token_id", 256, r"pad_token_id=256 \(from model\.generation_config\) is invalid"),
])
def test_bad_ids_in_the_generation_config(field, value, message):
    inner = kvtopo.compile(zoo.build("llama"), inductor=False)
    inner.generation_config.eos_token_id = 5
    setattr(inner.generation_config, field, value)
    model = Counting(inner)
    with kvtopo.session(kvtopo.Config.lossless()) as s:
        with pytest.raises(ValueError, match=message):
            kvtopo.generate(model, IDS, 2)
        assert s.calls == 0
    assert model.calls == 0


@pytest.mark.parametrize("how,backend", [
    ("plain", None),
    ("eager", "eager"),
    ("inductor", "inductor"),
    ("in-place-aot_eager", "aot_eager"),
])
def test_a_model_not_compiled_with_kvtopo_is_refused_before_the_prefill(how, backend):
    model = zoo.build("llama")
    if how == "in-place-aot_eager":
        model.compile(backend="aot_eager")
    elif how != "plain":
        model = torch.compile(model, backend=backend)
    assert compiled_backend(model) == backend
    counting = Counting(model)
    detail = "it is not compiled" if backend is None else f"it is compiled with backend='{backend}'"
    wrapped = "it is not compiled" + ("" if backend is None else f"; its submodule 'inner' is compiled with "
                                                                 f"backend='{backend}'")
    for target, how in ((model, detail), (counting, wrapped)):
        with kvtopo.session(kvtopo.Config.lossless()) as s:
            with pytest.raises(RuntimeError, match=rf"model \w+ is not compiled with backend='kvtopo' \({how}\); "
                                                   r"allowed: kvtopo\.compile\(model\) or torch\.compile\(model, "
                                                   r"backend='kvtopo'\)"):
                kvtopo.generate(target, IDS, 2)
            assert s.calls == 0
    assert counting.calls == 0


def test_compiled_backend_recognises_both_ways_of_compiling_with_kvtopo():
    from kvtopo.backend import kvtopo_backend

    assert compiled_backend(kvtopo.compile(zoo.build("llama"))) == "kvtopo"
    assert compiled_backend(torch.compile(zoo.build("llama"), backend="kvtopo")) == "kvtopo"
    assert compiled_backend(torch.compile(zoo.build("llama"), backend=kvtopo_backend)) == "kvtopo"
    assert compiled_backend(torch.compile(lambda x: x + 1, backend="kvtopo")) == "kvtopo"
    assert compiled_backend(lambda x: x + 1) is None


# -- export --------------------------------------------------------------------------------------
EXPORT_CASES = [
    ("onnx-max_context-0", kx.export_onnx, dict(max_context=0), ValueError, r"export_onnx: max_context=0 is invalid: an int >= 1"),
    ("onnx-max_context-neg", kx.export_onnx, dict(max_context=-64), ValueError, r"export_onnx: max_context=-64 is invalid"),
    ("onnx-max_context-float", kx.export_onnx, dict(max_context=512.0), ValueError, r"export_onnx: max_context=512\.0 is invalid"),
    ("onnx-max_context-bool", kx.export_onnx, dict(max_context=True), ValueError, r"export_onnx: max_context=True is invalid"),
    ("onnx-config-dict", kx.export_onnx, dict(config={"page_size": 16}), TypeError, r"export_onnx: config=\{'page_size': 16\} is invalid: None or a kvtopo\.Config"),
    ("onnx-out_dir-none", kx.export_onnx, dict(out_dir=None), TypeError, r"export_onnx: out_dir=None is invalid: a directory path"),
    ("mlir-max_context-0", kx.export_mlir, dict(max_context=0), ValueError, r"export_mlir: max_context=0 is invalid: an int >= 1"),
    ("mlir-tokens-0", kx.export_mlir, dict(tokens=0), ValueError, r"export_mlir: tokens=0 is invalid: an int >= 1"),
    ("mlir-tokens-too-many", kx.export_mlir, dict(tokens=600), ValueError, r"export_mlir: tokens=600 is invalid: at most max_context=512"),
    ("mlir-output_types-str", kx.export_mlir, dict(output_types="torch"), ValueError, r"export_mlir: output_types='torch' is invalid: a non-empty sequence of \("),
    ("mlir-output_types-unknown", kx.export_mlir, dict(output_types=("torch", "tosa")), ValueError, r"export_mlir: output_types=\('torch', 'tosa'\) is invalid"),
    ("mlir-output_types-empty", kx.export_mlir, dict(output_types=()), ValueError, r"export_mlir: output_types=\(\) is invalid"),
    ("mlir-config-str", kx.export_mlir, dict(config="lossless"), TypeError, r"export_mlir: config='lossless' is invalid"),
]


@pytest.mark.parametrize("function,overrides,error,message", [c[1:] for c in EXPORT_CASES], ids=[c[0] for c in EXPORT_CASES])
def test_bad_export_argument_raises_before_writing(tmp_path, function, overrides, error, message):
    out = tmp_path / "out"
    with pytest.raises(error, match=message):
        function(**{"model_or_zoo_name": "llama", "out_dir": out, **overrides})
    assert not out.exists()


def test_export_cli_refuses_max_context_0(tmp_path, capsys):
    from kvtopo.cli import main

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        main(["export", "onnx", "llama", "--out", str(out), "--max-context", "0"])
    assert exit_info.value.code == 2
    assert "--max-context 0 is invalid: an int >= 1" in capsys.readouterr().err
    assert not out.exists()



# -- decode-step masks -----------------------------------------------------------------------------
def test_a_decode_step_mask_that_hides_the_new_token_is_refused():
    """A one-token chunk's mask passes at a glance when it shows the token, and is refused with
    the general message when it hides it."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 1, 8, generator=g) for _ in range(3))
    with kvtopo.session(kvtopo.Config.lossless()) as s, s.step(torch.ones(1, 1, dtype=torch.bool)):
        s.attend("a", q, k, v, torch.ones(1, 1, dtype=torch.bool), 0.35, is_causal=False)
        s.attend("b", q, k, v, torch.zeros(1, 1, 1, 1), 0.35, is_causal=False)  # additive 0: shown
        with pytest.raises(ValueError, match="hides key 0 for query 0"):
            s.attend("c", q, k, v, torch.zeros(1, 1, dtype=torch.bool), 0.35, is_causal=False)
        with pytest.raises(ValueError, match="hides key 0 for query 0"):
            s.attend("d", q, k, v, torch.full((1, 1, 1, 1), -float("inf")), 0.35, is_causal=False)
        assert set(s.layers) == {"a", "b"}  # the refused calls stored nothing


def test_a_mask_checked_once_is_checked_again_when_it_changes():
    """The checks run once for the mask a model passes to all its layers; the same tensor changed
    in place, a new tensor, or other arguments are checked again and refused when wrong."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 8, generator=g) for _ in range(3))
    causal = torch.ones(3, 3, dtype=torch.bool).tril()
    with kvtopo.session(kvtopo.Config.lossless()) as s:
        s.attend("a", q, k, v, causal, 0.35, is_causal=False)
        s.attend("b", q, k, v, causal, 0.35, is_causal=False)
        causal[0, 2] = True  # in place: query 0 now sees key 2
        with pytest.raises(ValueError, match="shows key 2 for query 0"):
            s.attend("c", q, k, v, causal, 0.35, is_causal=False)
        with pytest.raises(ValueError, match="shows key 1 for query 0"):
            s.attend("d", q, k, v, torch.ones(3, 3, dtype=torch.bool), 0.35, is_causal=False)
        with pytest.raises(ValueError, match="not causal"):
            s.attend("e", q, k, v, None, 0.35, is_causal=False)
        assert set(s.layers) == {"a", "b"}
