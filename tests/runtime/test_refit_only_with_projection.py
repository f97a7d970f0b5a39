"""Only projected Mid pages have bases to refit: topo starts new Mid epochs as the sequence grows
(`MidEncoding.refit`, `Lifecycle.next_refit`) only when it projects (`key_energy` set) and
`refit_after` is set; an unprojected topo (the default config) and palu (fitted once, by
design) never refit, whatever `refit_after` says."""

import pytest

from kvtopo import Config
from kvtopo.runtime.lifecycle import Lifecycle
from kvtopo.runtime.policies import make_policy


@pytest.mark.parametrize("fields, refits", [
    (dict(), False),  # default topo: refit_after=2048 but no projection
    (dict(refit_after=16), False),
    (dict(key_energy=0.9, value_energy=0.9), True),
    (dict(key_energy=0.9, value_energy=0.9, refit_after=None), False),
    (dict(key_energy=0.9), True),  # an MLA latent's keys alone
    (dict(policy="palu"), False),
    (dict(policy="palu", refit_after=16), False),
    (dict(policy="kivi", target_ratio=None), False),
    (dict(policy="snapkv"), False),
])
def test_mid_epochs_start_only_where_bases_are_refitted(fields, refits):
    config = Config(**fields)
    policy = make_policy(config)
    assert policy.mid_encoding().refit is refits
    lifecycle = Lifecycle(config, policy)
    expected = 2 * max(100, config.refit_after) if refits else None
    assert lifecycle.next_refit(100) == expected
