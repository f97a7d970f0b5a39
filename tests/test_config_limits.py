"""Config accepts every value at the edge of each documented range and refuses the first one
past it: page_size in [1, 4096], target_ratio >= 1, energies in (0, 1], token counts >= 0
(sink_tokens, recent_tokens, prompt_hold_tokens) or >= 1 (the rest)."""

import pytest

from kvtopo import Config


@pytest.mark.parametrize("field, edge, past", [
    ("page_size", 4096, 4097),
    ("page_size", 1, 0),
    ("target_ratio", 1, 0.999),
    ("target_ratio", 1.0, 0.999),
    ("key_energy", 1.0, 1.0000001),
    ("sink_tokens", 0, -1),
    ("recent_tokens", 0, -1),
    ("prompt_hold_tokens", 0, -1),
    ("observation_window", 1, 0),
    ("refit_after", 1, 0),
    ("layer_budget_bytes", 1, 0),
    ("max_pages", 1, 0),
    ("prefill_chunk_size", 1, 0),
])
def test_the_edge_of_each_range_is_accepted_and_the_next_value_refused(field, edge, past):
    assert getattr(Config(**{field: edge}), field) == edge
    with pytest.raises(ValueError, match=rf"Config\.{field}={past!r} is invalid"):
        Config(**{field: past})
