"""A planned step's prediction at its own op speed, and the drift rule that re-plans (Note [Planned steps])."""
from __future__ import annotations

import pytest

from dtr.runtime.step_plans import PlanPolicy, StepPlans, _at_step_speed
from dtr.sim.step_plan import StepPlan


def _plan(unit: str = "ns", predicted: float = 1e9, base: float = 4e9) -> StepPlan:
    return StepPlan((7, 8), (0, 0, 0), (), "ok", "lookahead", 100, predicted, 2 * predicted, base, unit)


def test_the_prediction_scales_with_the_step_s_op_time():
    got = _at_step_speed(_plan(), {"base_compute": 5e9, "cost_unit": "ns"})
    assert got["op_time_ratio"] == pytest.approx(1.25)
    assert got["expected_remat_seconds"] == pytest.approx(1.25)  # 1e9 ns at the recorded speed, 25% slower


@pytest.mark.parametrize("plan,stats", [
    (None, {"base_compute": 5e9, "cost_unit": "ns"}),                        # the step followed no plan
    (_plan("flop"), {"base_compute": 5e9, "cost_unit": "flop"}),             # costs that are not times
    (_plan(base=0.0), {"base_compute": 5e9, "cost_unit": "ns"}),             # nothing recorded to compare
])
def test_no_expectation_without_a_timed_plan(plan, stats):
    assert _at_step_speed(plan, stats) == {"op_time_ratio": None, "expected_remat_seconds": None}


def _steps(plans: StepPlans, plan: StepPlan, base: float, remat_seconds: float, n: int) -> None:
    for _ in range(n):
        stats = {"base_compute": base, "cost_unit": "ns", "remat_seconds": remat_seconds}
        plans._check_drift(plan, stats, _at_step_speed(plan, stats)["expected_remat_seconds"])


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
