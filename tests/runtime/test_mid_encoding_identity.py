"""`MidEncoding.identity` (Mid pages may stay in the exact page pool) holds only when a Mid page
is stored exactly as it was: nothing evicted, nothing projected, neither keys nor values coded.
Any one of those alone makes the encoding lossy, values' bits included."""

import dataclasses

import pytest

from kvtopo import Config
from kvtopo.runtime.policies import make_policy
from kvtopo.runtime.policies.base import MidEncoding


def test_the_default_encoding_is_the_identity():
    assert MidEncoding().identity


@pytest.mark.parametrize("change", [dict(evict=True), dict(project=True), dict(key_bits=4), dict(value_bits=4),
                                    dict(value_bits=2), dict(key_bits=8, value_bits=8)])
def test_any_one_lossy_part_makes_the_encoding_lossy(change):
    assert not dataclasses.replace(MidEncoding(), **change).identity


def test_a_cap_or_refit_alone_changes_no_stored_token():
    # max_tokens only acts through eviction, refit only through projection.
    assert MidEncoding(max_tokens=3).identity and MidEncoding(refit=True).identity


@pytest.mark.parametrize("fields, identity", [
    (dict(policy="full", target_ratio=None), True),
    (dict(policy="kivi", mid_bits=None, target_ratio=None), True),
    (dict(policy="kivi", mid_bits=2, target_ratio=None), False),
    (dict(policy="topo", mid_bits=None, target_ratio=None), True),
    (dict(policy="topo", mid_bits=4, target_ratio=None), False),
    (dict(policy="snapkv", target_ratio=None), True),
    (dict(policy="snapkv", target_ratio=4.0), False),
    (dict(policy="palu", target_ratio=None), False),
    (dict(policy="streaming", target_ratio=None), False),
])
def test_each_policy_is_the_identity_exactly_when_it_keeps_mid_exact(fields, identity):
    assert make_policy(Config(**fields)).mid_encoding().identity is identity
