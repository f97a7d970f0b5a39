"""Two gloo ranks run the zoo Llama (4 query heads, 2 kv-heads) loaded with tp_plan="auto" and
compiled with kvtopo: lossless tokens equal the single-process uncompiled model's, each rank's
store holds its one kv-head (half the single-process bytes), and the default compressed config
runs and evicts. The ranks are this file run as a script, one process each, with torchrun's variables."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

PROMPT = 200  # past sink (32) + recent (64) tokens, so the default config has Mid pages to compress
NEW_TOKENS = 8
WORLD = 2
TIMEOUT_S = 240


def _prompt() -> torch.Tensor:
    return (torch.arange(PROMPT) * 7 % 251 + 1).unsqueeze(0)


def _rank_main(checkpoint: str, out_dir: str) -> None:
    """One rank: lossless then default-config generation, results to out_dir/rank<r>.json."""
    torch.set_num_threads(1)
    import kvtopo
    from kvtopo.serving.tensor_parallel import load_tensor_parallel, stored_kv_heads

    model = load_tensor_parallel(checkpoint, inductor=False)
    result = {}
    # "compressed": Config()'s coding with a Recent window short enough that 200 tokens reach Mid.
    compressed = kvtopo.Config(recent_tokens=64)
    for name, config in (("lossless", kvtopo.Config.lossless()), ("compressed", compressed)):
        with kvtopo.session(config) as s:
            out = kvtopo.generate(model, _prompt(), max_new_tokens=NEW_TOKENS)
            stats = s.stats()
            result[name] = dict(tokens=out[0, PROMPT:].tolist(), bytes=stats.total_bytes, fp16_bytes=stats.fp16_bytes,
                                kv_heads=sorted(set(stored_kv_heads(s).values())),
                                held=max(max(held) for held in stats.held_tokens.values()), stored=max(stats.tokens))
    rank = torch.distributed.get_rank()
    torch.manual_seed(100 + rank)  # each rank's own random state, as a script that seeds nothing may leave it
    with kvtopo.session(kvtopo.Config.lossless()):
        out = kvtopo.generate(model, _prompt(), max_new_tokens=NEW_TOKENS, do_sample=True, temperature=2.0, top_k=None)
        result["sampled"] = dict(tokens=out[0, PROMPT:].tolist())
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()  # rank 0 hosts the store: no rank tears down while another still talks to it
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    # Skip interpreter teardown, where gloo's threads can abort a process (SIGABRT) after its work is done.
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from kvtopo.models import zoo

    model = zoo.build("llama")
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def ranks(checkpoint, tmp_path_factory):
    _, path = checkpoint
    out = tmp_path_factory.mktemp("ranks")
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(WORLD),
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-X", "faulthandler", __file__, str(path), str(out)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(WORLD)]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if any(proc.returncode for proc in procs):
        report = "\n".join(f"rank {r} exited with {proc.returncode}, results written: {(out / f'rank{r}.json').exists()}"
                           f":\n{log[-3000:]}" for r, (proc, log) in enumerate(zip(procs, logs)))
        pytest.fail(report)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture(scope="module")
def single_process(checkpoint):
    """The uncompiled model's greedy tokens, and the lossless store's bytes of one process."""
    import kvtopo

    model, _ = checkpoint
    with torch.no_grad():
        reference = model.generate(_prompt(), max_new_tokens=NEW_TOKENS, do_sample=False)[0, PROMPT:].tolist()
    compiled = kvtopo.compile(model, inductor=False)
    with kvtopo.session(kvtopo.Config.lossless()) as s:
        kvtopo.generate(compiled, _prompt(), max_new_tokens=NEW_TOKENS)
        return reference, s.stats().total_bytes


@pytest.mark.parametrize("size", [0, -2, 1.5])
def test_a_tp_size_that_is_not_a_positive_int_is_refused(checkpoint, size):
    from kvtopo.serving.tensor_parallel import load_tensor_parallel

    with pytest.raises(ValueError, match=f"tp_size={size!r} is invalid"):
        load_tensor_parallel(checkpoint[1], tp_size=size)


def test_heads_must_divide_only_where_the_plan_shards_attention(tmp_path, monkeypatch):
    """DeepSeek-V3's plan (MLA) shards only the MLP and experts: its head count need not divide by
    the ranks (before, such a model was refused for heads no rank splits)."""
    from transformers import AutoModelForCausalLM

    from kvtopo.models import zoo
    from kvtopo.serving.tensor_parallel import load_tensor_parallel, shards_attention

    llama, deepseek = zoo.build("llama").config, zoo.build("deepseek-v3").config
    assert shards_attention(llama) and not shards_attention(deepseek)
    assert deepseek.num_attention_heads % 3 and llama.num_attention_heads % 3

    class Loaded(Exception):
        pass

    def load(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", load)
    deepseek.save_pretrained(tmp_path / "deepseek")
    with pytest.raises(Loaded):
        load_tensor_parallel(tmp_path / "deepseek", tp_size=3)
    llama.save_pretrained(tmp_path / "llama")
    with pytest.raises(ValueError, match="needs the heads to divide: LlamaConfig has 4 query heads and 2 kv-heads"):
        load_tensor_parallel(tmp_path / "llama", tp_size=3)


@pytest.mark.parametrize("config_class", ["GPTNeoXConfig", "GPTJConfig", "CodeGenConfig"])
def test_plans_sharding_attention_under_other_module_names_need_the_heads_to_divide(tmp_path, config_class):
    """GPT-NeoX (`attention.query_key_value`), GPT-J and CodeGen (`attn.*`) split attention by
    heads under other names than `self_attn`: 4 heads over 3 ranks is refused before loading."""
    import transformers

    from kvtopo.serving.tensor_parallel import load_tensor_parallel, shards_attention

    config = getattr(transformers, config_class)(hidden_size=32, num_attention_heads=4, n_embd=32, n_head=4,
                                                 rotary_dim=4, num_hidden_layers=1, n_layer=1, vocab_size=64)
    assert shards_attention(config)
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="needs the heads to divide"):
        load_tensor_parallel(tmp_path, tp_size=3)


def test_lossless_tokens_equal_the_single_process_model(ranks, single_process):
    reference, _ = single_process
    assert [r["lossless"]["tokens"] for r in ranks] == [reference] * WORLD


def test_sampled_tokens_are_the_same_on_every_rank(ranks):
    """Each rank draws from its own random state: rank 0's draw is fed on every rank."""
    tokens = [r["sampled"]["tokens"] for r in ranks]
    assert len(tokens[0]) == NEW_TOKENS and tokens[0] == tokens[1]


def test_each_rank_stores_only_its_kv_heads(ranks, single_process):
    _, single_bytes = single_process
    for r in ranks:
        assert r["lossless"]["kv_heads"] == [1]  # 2 kv-heads over 2 ranks
        assert r["lossless"]["bytes"] == pytest.approx(single_bytes / WORLD, rel=0.01)


def test_default_config_compresses_on_every_rank(ranks):
    tokens = [r["compressed"]["tokens"] for r in ranks]
    assert len(tokens[0]) == NEW_TOKENS and tokens[0] == tokens[1]  # the logits are all-reduced: ranks agree
    for r in ranks:
        assert r["compressed"]["kv_heads"] == [1]
        assert r["compressed"]["held"] < r["compressed"]["stored"] == PROMPT + NEW_TOKENS - 1  # Mid tokens evicted
        assert r["compressed"]["bytes"] < r["lossless"]["bytes"] / 2


if __name__ == "__main__":
    _rank_main(*sys.argv[1:])
