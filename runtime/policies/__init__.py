"""Compression policies by name. Each is one small class in its own file."""

from .base import MidEncoding, Policy, ScoreInputs
from .full import Full
from .h2o import H2O
from .kivi import KIVI
from .knorm import KNorm
from .palu import Palu
from .snapkv import SnapKV
from .streaming import Streaming
from .topo import Topo

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (Full, Topo, Streaming, SnapKV, H2O, KNorm, KIVI, Palu)}


def make_policy(config) -> Policy:
    return POLICIES[config.policy](config)


__all__ = ["POLICIES", "MidEncoding", "Policy", "ScoreInputs", "make_policy"]
