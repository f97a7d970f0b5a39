"""kvtopo under transformers' tensor parallelism (`tp_plan="auto"`, one process per rank).

    # torchrun --nproc-per-node 2 script.py   (gloo on CPU, NCCL on GPUs: transformers picks it)
    import kvtopo
    from kvtopo.serving.tensor_parallel import load_tensor_parallel, stored_kv_heads

    model = load_tensor_parallel(checkpoint_dir)          # this rank's shard, compiled with kvtopo
    with kvtopo.session(kvtopo.Config()) as s:            # one session per rank
        out = kvtopo.generate(model, input_ids, max_new_tokens=64)   # same tokens on every rank (sampled: rank 0's)
        s.stats().total_bytes                              # this rank's kv-heads only

How it fits together (checked against transformers 5.24.0): the plan shards q/k/v_proj
column-wise and o_proj row-wise, so each rank computes attention for a contiguous block of
query heads and the kv-heads they read (GQA groups stay whole when both counts divide by the
world size). Without autograd (`torch.no_grad`, as `kvtopo.generate` runs) transformers' linear
layers take and return plain local tensors, so attention sees a rank's heads as an ordinary
[batch, local heads, tokens, dim] tensor: the kvtopo passes find it as they would in one process
and each rank's session stores only its own kv-heads' pages. The one collective of the attention
block, o_proj's all-reduce, runs after the kvtopo op. The parameters stay DTensors, which is why
the passes name the model by a plain (replicated) parameter (`passes.graph_utils.model_key`).
Where a model's plan leaves attention whole (DeepSeek-V3's MLA: only the MLP and experts are
sharded, `shards_attention`), every rank runs every head and stores the whole latent, as one
process does; tokens are still the single-process model's.

Compression is decided per rank, with no communication. The store decides per kv-head or over
its own (sequence, layer) store: Mid codes and projection bases are per head, and the budget is
a byte count of the store. `target_ratio` therefore holds on every rank (its budget scales with
the rank's heads), and so for the whole model; `layer_budget_bytes` bounds each rank's store
(the single-process figure divided by the world size gives the same total). What differs from
one process is eviction's page counts: with `eviction_scope="append"` a page keeps as many
tokens as its best head needs, and a rank sees only its own heads, so the ranks may keep
different counts of the same page (each head still keeps its own best tokens). Synchronising
would cost a collective inside every store append, on the host, with every rank waiting for the
slowest; and it still would not make the compressed tokens bitwise those of one process: the
all-reduce adds o_proj's partial sums in another order, so activations differ in the last bits
and a near-tie in a score can fall either way. Lossless configs store every token, so their
tokens equal the single-process model's.
"""

from __future__ import annotations

import os

import torch

__all__ = ["load_tensor_parallel", "shards_attention", "stored_kv_heads"]


def load_tensor_parallel(path, *, tp_size: int | None = None, inductor: bool = True,
                         dtype: torch.dtype = torch.float32, **from_pretrained_kwargs) -> torch.nn.Module:
    """Load the checkpoint at `path` with `tp_plan="auto"` across the processes torchrun (or its
    RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT variables) started, and compile it with kvtopo
    in place. transformers starts the process group (gloo on CPU) and the device mesh.
    `tp_size`: ranks to shard over (default: the world size). Where the plan shards attention,
    raises if the model's query or kv-head count does not divide by it: a rank would otherwise
    hold part of a GQA group."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    config = AutoConfig.from_pretrained(path)
    size = tp_size if tp_size is not None else int(_env("WORLD_SIZE"))
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"load_tensor_parallel: tp_size={size!r} is invalid: None (the world size) or an int >= 1")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if shards_attention(config) and (heads % size or kv_heads % size):
        raise ValueError(f"tensor parallel over {size} ranks needs the heads to divide: {type(config).__name__} "
                         f"has {heads} query heads and {kv_heads} kv-heads")
    model = AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_plan="auto", tp_size=size), dtype=dtype,
        **from_pretrained_kwargs)
    model.eval()
    model.compile(backend="kvtopo", options={"inductor": inductor})
    return model


_ATTENTION_MODULES = {"self_attn", "attn", "attention", "self_attention"}
_ATTENTION_PROJECTIONS = {"q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "c_attn"}


def shards_attention(config) -> bool:
    """Whether the model's tensor-parallel plan splits attention by heads: an entry under an
    attention module (Llama's `self_attn`, GPT-J's and CodeGen's `attn`, GPT-NeoX's `attention`)
    or a query/key/value projection. DeepSeek-V3's (MLA) shards only its MLP and experts: every
    rank runs all heads and stores the whole latent."""
    for entry in getattr(config, "base_model_tp_plan", None) or {}:
        *modules, name = entry.split(".")
        if _ATTENTION_MODULES & set(modules) or name in _ATTENTION_PROJECTIONS:
            return True
    return False


def stored_kv_heads(session) -> dict[str, int]:
    """Per layer store of `session` (a `kvtopo.Session`), the kv-heads its pages hold."""
    return {name: layer.pool.keys.shape[1] for name, layer in session.layers.items() if layer.pool is not None}


def _env(name: str) -> str:
    value = os.environ.get(name)
    if value is None:
        raise RuntimeError(f"{name} is not set: start one process per rank with torchrun (or set RANK, WORLD_SIZE, "
                           "MASTER_ADDR and MASTER_PORT yourself)")
    return value
