"""A left-padded batch of random prompts, as a tokenizer pads a batch for generation."""

import torch


def left_padded(lengths, seed: int):
    """(ids [B, longest], mask [B, longest], the prompts): random token ids 0..255 of each length,
    padded on the left with 0 (mask 0)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (n,), generator=gen) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = p
        mask[row, width - len(p):] = 1
    return ids, mask, prompts
