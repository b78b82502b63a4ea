"""A planned step's prediction (its op speed, the runtime's own time) and the drift rule (Note [Planned steps])."""
from __future__ import annotations

import pytest

from dtr.runtime.step_plans import OVERHEAD_STEPS, PlanPolicy, StepPlans, _at_step_speed
from dtr.sim.step_plan import StepPlan


def _plan(unit: str = "ns", predicted: float = 1e9, base: float = 4e9, remats: int = 0) -> StepPlan:
    return StepPlan((7, 8), (0, 0, 0), (), "ok", "lookahead", 100, predicted, 2 * predicted, base, unit,
                    predicted_remats=remats)


def test_the_prediction_scales_with_the_step_s_op_time():
    got = _at_step_speed(_plan(), {"base_compute": 5e9, "cost_unit": "ns"}, 0.0)
    assert got["op_time_ratio"] == pytest.approx(1.25)
    assert got["expected_remat_seconds"] == pytest.approx(1.25)  # 1e9 ns at the recorded speed, 25% slower


def test_the_prediction_adds_the_runtime_s_own_time_per_recomputation():
    got = _at_step_speed(_plan(remats=40), {"base_compute": 5e9, "cost_unit": "ns"}, 50e-6)
    assert got["expected_remat_seconds"] == pytest.approx(1.25 + 40 * 50e-6)  # (not scaled by the op speed)


def _stats(remats: int, remat_seconds: float, remat_compute: float, unit: str = "ns") -> dict:
    return {"remats": remats, "remat_seconds": remat_seconds, "remat_compute": remat_compute, "cost_unit": unit}


def test_the_runtime_s_cost_of_a_recomputation_is_the_median_of_recent_steps():
    plans = StepPlans(PlanPolicy(), 100)
    assert plans.remat_overhead_seconds == 0.0                   # nothing measured yet
    plans._observe_overhead(_stats(0, 0.0, 0.0))                 # no recomputation: nothing to learn
    plans._observe_overhead(_stats(10, 1.0, 1e9, unit="flop"))   # costs that are not times
    assert plans.remat_overhead_seconds == 0.0
    plans._observe_overhead(_stats(10, 0.0105, 1e7))             # 0.5 ms beyond 10 ms of ops, over 10
    assert plans.remat_overhead_seconds == pytest.approx(50e-6)
    plans._observe_overhead(_stats(4, 0.0010, 2e6))              # faster than its ops' costs: never below 0
    plans._observe_overhead(_stats(5, 0.0015, 1e6))              # 100 us each
    assert plans.remat_overhead_seconds == pytest.approx(50e-6)  # the median of 0, 50 and 100 us
    for _ in range(OVERHEAD_STEPS):                              # only the recent steps count
        plans._observe_overhead(_stats(2, 0.0004, 0.0))
    assert plans.remat_overhead_seconds == pytest.approx(200e-6)


@pytest.mark.parametrize("plan,stats", [
    (None, {"base_compute": 5e9, "cost_unit": "ns"}),                        # the step followed no plan
    (_plan("flop"), {"base_compute": 5e9, "cost_unit": "flop"}),             # costs that are not times
    (_plan(base=0.0), {"base_compute": 5e9, "cost_unit": "ns"}),             # nothing recorded to compare
])
def test_no_expectation_without_a_timed_plan(plan, stats):
    assert _at_step_speed(plan, stats, 1e-4) == {"op_time_ratio": None, "expected_remat_seconds": None}


def _steps(plans: StepPlans, plan: StepPlan, base: float, remat_seconds: float, n: int) -> None:
    for _ in range(n):
        stats = {"base_compute": base, "cost_unit": "ns", "remat_seconds": remat_seconds}
        plans._check_drift(plan, stats, _at_step_speed(plan, stats, 0.0)["expected_remat_seconds"])


def test_a_slower_machine_is_no_drift():
    plans, plan = StepPlans(PlanPolicy(drift=0.2), 100), _plan()
    plans.plans[plan.signature] = plan
    _steps(plans, plan, base=4e9 * 1.6, remat_seconds=1.6, n=5)  # every op 60% slower, recomputation too
    assert plan.signature in plans.plans


def test_recomputation_that_keeps_straying_is_planned_again():
    plans, plan = StepPlans(PlanPolicy(drift=0.2), 100), _plan()
    plans.plans[plan.signature] = plan
    plans.tried.add(plan.signature)
    _steps(plans, plan, base=4e9, remat_seconds=1.6, n=2)      # two steps out: not yet
    assert plan.signature in plans.plans
    _steps(plans, plan, base=4e9, remat_seconds=1.0, n=1)      # one in: the count starts again
    _steps(plans, plan, base=4e9, remat_seconds=1.6, n=2)
    assert plan.signature in plans.plans
    _steps(plans, plan, base=4e9, remat_seconds=1.6, n=1)      # the third running
    assert plan.signature not in plans.plans and plan.signature not in plans.tried
    assert plans.seen[plan.signature] == plans.policy.repeat   # so the next step of it is recorded again
