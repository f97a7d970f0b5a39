"""Compression policies by name. Each is one small class in its own file."""

from .base import MidEncoding, Policy, ScoreInputs
from .full import Full
from .topo import Topo

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (Full, Topo)}


def make_policy(config) -> Policy:
    return POLICIES[config.policy](config)


__all__ = ["POLICIES", "MidEncoding", "Policy", "ScoreInputs", "make_policy"]
