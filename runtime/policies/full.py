"""Full cache: every token kept exactly (the lossless reference)."""

from .base import Policy


class Full(Policy):
    name = "full"
