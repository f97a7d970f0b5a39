"""kvtopo in one screen: compile a zoo model, show the rewritten attention, generate in a session."""

import torch

import kvtopo
from kvtopo.models import zoo


def main() -> None:
    model = zoo.build("llama")
    prompt = torch.randint(0, model.config.vocab_size, (1, 96), generator=torch.Generator().manual_seed(0))

    report = kvtopo.inspect(model, prompt[:, :8], use_cache=False)
    print(report.format())

    kvtopo.compile(model)  # == model.compile(backend="kvtopo")
    config = kvtopo.Config.lossless(prefill_chunk_size=32)
    with kvtopo.session(config) as session:
        out = kvtopo.generate(model, prompt, max_new_tokens=24)
        stats = session.stats()

    with torch.no_grad():
        expected = zoo.build("llama").generate(prompt, max_new_tokens=24, do_sample=False)
    print(f"\nprompt: {prompt.shape[1]} tokens, generated: {out[0, prompt.shape[1]:].tolist()}")
    print(f"same tokens as the uncompiled model's HF generate: {torch.equal(out, expected)}")
    print(f"KV cache held: {stats.total_bytes} bytes for {stats.tokens[0]} tokens "
          f"({stats.ratio_vs_fp16:.2f}x vs an fp16 cache of the same tokens)")
    for layer, nbytes in stats.per_layer.items():
        print(f"  {layer}: {nbytes} bytes")
    print("  by kind: " + ", ".join(f"{k}={v}" for k, v in stats.per_kind.items()))


if __name__ == "__main__":
    main()
