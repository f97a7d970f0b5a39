"""HostRunner over the zoo Llama's ONNX export (the export test_onnx.py makes, shared through
the onnx_export fixture): what it refuses and what it accepts at its limits.

* A config that differs from the exported one in what the graphs bake in besides the fields
  test_host_runner_graph_fields.py covers: the policy (the compressor implements one policy's
  encoding), protected spans (they size the exact buffers and pick the exact pages) and whether
  Mid is projected at all (energies set vs None: the graphs take bases or none). Accepted, the
  host would run one config's lifecycle over another's graphs.
* A sequence may reach exactly max_context tokens (the buffers' capacity), not one more.
* `generate(prefill_chunk_size=N)` feeds the prompt N tokens per call, as a session with
  `prefill_chunk_size=N` does (bases are fitted on what is held when the first page reaches Mid,
  so the chunking changes what is computed)."""

import numpy as np
import pytest
import torch

from kvtopo.export.host_runner import HostRunner

from export_common import CONFIG, graph_config

MAX_CONTEXT = 288  # 256 + 32: the export test_onnx.py makes


@pytest.fixture(scope="module")
def llama_export(onnx_export):
    out, _ = onnx_export("llama", CONFIG, MAX_CONTEXT)
    return out


@pytest.mark.parametrize("change, fields", [
    (dict(policy="palu"), ["policy"]),
    (dict(protected_spans=((0, 40),)), ["protected_spans"]),
    (dict(key_energy=None, value_energy=None), ["key_energy", "value_energy"]),
], ids=["policy", "protected_spans", "unprojected"])
def test_a_config_differing_in_policy_spans_or_projection_is_refused(change, fields, llama_export):
    exported = graph_config(CONFIG)
    with pytest.raises(ValueError, match=rf"differs from the exported one in {fields!r}".replace("[", r"\[")
                       .replace("]", r"\]") + ".*re-export"):
        HostRunner(llama_export, config=exported.replace(**change))
    # Other energies that still project (the graphs take bases of any rank up to the capacity) are fine.
    assert HostRunner(llama_export, config=exported.replace(key_energy=0.8, value_energy=0.8)).config.key_energy == 0.8


def test_a_sequence_may_fill_max_context_exactly(llama_export):
    runner = HostRunner(llama_export)
    ids = torch.randint(0, runner.layout.vocab_size, (MAX_CONTEXT + 1,),
                        generator=torch.Generator().manual_seed(3)).numpy()
    for start in range(0, MAX_CONTEXT, 64):
        logits = runner.forward(ids[start:min(start + 64, MAX_CONTEXT)], prompt_end=MAX_CONTEXT)
        assert np.isfinite(logits).all()
    assert runner.position == MAX_CONTEXT
    with pytest.raises(RuntimeError, match=f"{MAX_CONTEXT + 1} tokens exceed the export's max_context {MAX_CONTEXT}"):
        runner.forward(ids[MAX_CONTEXT:])


def test_generate_prefills_in_the_chunks_asked_for(llama_export):
    ids = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(4)).numpy()
    runner = HostRunner(llama_export)
    ids = ids % runner.layout.vocab_size
    calls = []
    forward = runner.forward
    runner.forward = lambda chunk, prompt_end=0: calls.append(len(chunk)) or forward(chunk, prompt_end)
    tokens, logits = runner.generate(ids, 4, prefill_chunk_size=16, return_logits=True)
    assert calls == [16] * 6 + [4] + [1] * 3
    # The same run as a runner whose config prefills 16 tokens per call.
    chunked = HostRunner(llama_export, config=graph_config(CONFIG).replace(prefill_chunk_size=16))
    ref_tokens, ref_logits = chunked.generate(ids, 4, return_logits=True)
    assert np.array_equal(tokens, ref_tokens) and np.array_equal(logits, ref_logits)
    # ... which is not the run of the exported config's 64-token chunks (so the chunking was applied).
    _, default_logits = HostRunner(llama_export).generate(ids, 4, return_logits=True)
    assert not np.array_equal(logits, default_logits)


def test_a_refit_reachable_exactly_at_max_context_is_refused(llama_export):
    """The session refits the Mid bases once a sequence holds 2 * refit_after tokens; the graphs
    hold one basis set per layer. A sequence may reach max_context tokens, so refit_after =
    max_context / 2 would refit on the last token: refused. One token later is out of reach."""
    exported = graph_config(CONFIG)
    with pytest.raises(ValueError, match="refit_after"):
        HostRunner(llama_export, config=exported.replace(refit_after=MAX_CONTEXT // 2))
    assert HostRunner(llama_export, config=exported.replace(refit_after=MAX_CONTEXT // 2 + 1)).config.refit_after \
        == MAX_CONTEXT // 2 + 1
