"""kvtopo.generate's top-k keeps the k best tokens, the k-th included: sampling with top_k=1 is
greedy decoding (kvtopo.generate's argmax path: what top-k sampling must not change), whatever
the temperature and seed."""

import torch

import kvtopo
from kvtopo.models import zoo


def test_top_k_1_samples_the_greedy_tokens():
    compiled = kvtopo.compile(zoo.build("llama"), inductor=False)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    greedy = kvtopo.generate(compiled, ids, 6, config=kvtopo.Config.lossless(), do_sample=False, eos_token_id=None)
    for seed in (0, 1):
        sampled = kvtopo.generate(compiled, ids, 6, config=kvtopo.Config.lossless(), do_sample=True, top_k=1,
                                  temperature=3.0, top_p=None, eos_token_id=None,
                                  generator=torch.Generator().manual_seed(seed))
        assert torch.equal(sampled, greedy)
