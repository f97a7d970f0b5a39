"""bench/needle_survival.py's counting, on the plans a real session makes (tiny zoo Llama) and on
hand-made ones; the real-model run itself takes minutes and is not run here."""

import sys
from pathlib import Path

import torch

import kvtopo
from kvtopo.models import zoo
from kvtopo.runtime import layer_cache
from kvtopo.runtime.phases import Phase

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import needle_survival as NS  # noqa: E402


def test_kept_in_span_counts_plan_survivors_and_uncovered_pages():
    # page 1 keeps tokens 0 and 3 in head 0, token 1 in head 1; pages 0 and 2 are not in the plan
    plan = {1: torch.tensor([[0, 3], [1, 2]])}
    # span 6..14 over pages of 4: page 1 tokens 6, 7 (of which kept: 7 in head 0, 6 in head 1),
    # page 2 (8..11) and page 3 (12, 13) uncovered
    assert NS.kept_in_span(plan, 4, 2, (6, 14)) == [1 + 6, 1 + 6]
    # a span inside page 1 alone
    assert NS.kept_in_span(plan, 4, 2, (4, 8)) == [2, 2]
    assert NS.kept_in_span({0: torch.zeros(2, 0, dtype=torch.long)}, 4, 2, (0, 4)) == [0, 0]


def test_recorded_plans_match_the_store_and_restore_the_planner():
    torch.manual_seed(0)
    model = kvtopo.compile(zoo.build("llama"), inductor=False)
    config = kvtopo.Config(policy="topo", target_ratio=4, page_size=8, sink_tokens=8, recent_tokens=16,
                           observation_window=8, prefill_chunk_size=512)
    planner = layer_cache.LayerCache._plan_joint_eviction
    prompt = torch.randint(0, 256, (1, 200))
    with kvtopo.session(config), NS.recorded_plans() as plans, torch.no_grad():
        kvtopo.generate(model, prompt, 2, eos_token_id=None, progress=False)
        assert plans, "a 4x budget over 200 tokens must evict"
        for cache, plan in plans:  # what each plan keeps is what its layer's store holds
            pages = cache.sequences[0].pages
            assert {page: tokens.shape[1] for page, tokens in plan.items()} == {page: pages[page].kept for page in plan}
            assert all(pages[page].phase is Phase.MID for page in plan)
    assert layer_cache.LayerCache._plan_joint_eviction is planner
    cache, plan = plans[0]
    P, heads = config.page_size, next(iter(plan.values())).shape[0]
    everything = NS.kept_in_span(plan, P, heads, (0, 200))
    dropped = sum(P - tokens.shape[1] for tokens in plan.values())
    assert everything == [200 - dropped] * heads
    assert 0 < dropped < 200
