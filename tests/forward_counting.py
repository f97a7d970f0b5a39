"""A model wrapper for kvtopo.generate tests: what each forward was given, counted."""

import torch


class Counting(torch.nn.Module):
    """Wraps a (compiled) model; `widths` holds each forward's token count, `calls` their number."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self.widths = []

    @property
    def calls(self) -> int:
        return len(self.widths)

    def forward(self, **kwargs):
        self.widths.append(kwargs["input_ids"].shape[1])
        return self.inner(**kwargs)

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()

    @property
    def generation_config(self):
        return self.inner.generation_config
