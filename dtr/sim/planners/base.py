"""What the planners share: their options, their result, and the registry they register in.

This module imports no planner (each planner imports it, and
:mod:`dtr.sim.planners` imports it and then every planner, so that the
planners register themselves); :mod:`dtr.sim.planners` re-exports its public
names.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Tuple

from dtr.registry import Registry
from dtr.sim.graph import PlanGraph
from dtr.sim.planners.bounds import memory_lower_bound

__all__ = ["PlanOptions", "PlanResult", "Planner", "register_planner", "get_planner", "planner_names", "run_planner",
           "STATUSES"]

#: Statuses a planner reports (docs/planners.md): ``optimal`` (proven, gap
#: tolerance <= 1e-6), ``ok`` (a schedule within the budget), ``infeasible``
#: (proven: nothing in the planner's space fits the budget, e.g. the constants
#: alone exceed it, or the budget is below the memory every schedule needs:
#: :mod:`dtr.sim.planners.bounds`), ``timeout`` (the time limit passed before
#: a schedule was found, or before the model this time limit allows could be
#: built or proven feasible: ``chen``'s grid, ``checkmate-lp``; for the ILP,
#: with the best incumbent it could not improve on and a gap),
#: ``oom`` (a heuristic search, ``chen``, ``fastsa``, ``checkmate-lp``'s
#: rounding or ``hierarchical``, found no plan within the budget; one may
#: still exist; ``lookahead`` also when its plans thrash), ``n/a``
#: (the planner does not apply to this graph).
STATUSES = ("optimal", "ok", "infeasible", "timeout", "oom", "n/a")


@dataclass(frozen=True)
class PlanOptions:
    """Knobs shared by the planners.

    Attributes:
        time_limit: seconds for the ILP solver, FastSA and ``hierarchical``.
        seed: seed of the randomized planners (LP rounding, FastSA).
        gap_tol: the ILP's relative gap tolerance (``optimal`` needs <= 1e-6).
        rounds: randomized rounding attempts of ``checkmate-lp``.
        sa_steps: FastSA's iterations (0: until the time limit or its default).
        rotor_slots: memory discretization of Rotor (slots of the budget).
        warm_start: FastSA also starts from the cheapest of Rotor's plan,
            Chen's, lookahead's and DTR's simulated runs that fits (Note [DTR runs as
            starts] in dtr.sim.export); the ILP gets the cost of the cheapest of
            Rotor's, Chen's and DTR's runs as a cutoff.
        in_order: the sequence computes each node for the first time in the
            graph's order, as a runtime step runs its program (Note [Schedules
            a step can follow] in dtr.sim.schedule). Only FastSA needs telling:
            it then anneals under the order, from in-order starts only; the
            other planners keep it always.
        start: a compute sequence FastSA also refines when it fits (another
            planner's: ``auto`` plans hand FastSA the best one so far).
    """

    time_limit: float = 60.0
    seed: int = 0
    gap_tol: float = 1e-6
    rounds: int = 32
    sa_steps: int = 0
    rotor_slots: int = 256
    warm_start: bool = True
    in_order: bool = False
    start: Optional[Tuple[int, ...]] = None


@dataclass(frozen=True)
class PlanResult:
    """What a planner found.

    Attributes:
        planner: its name.
        status: one of :data:`STATUSES`.
        sequence: the compute sequence of nodes (None: no schedule).
        solve_seconds: wall time of the planner.
        gap: the ILP's relative optimality gap (None for other planners).
        message: a short explanation (why n/a, infeasible...).
        predicted_cost: the planner's own figure for the total cost, if any.
    """

    planner: str
    status: str
    sequence: Optional[Tuple[int, ...]]
    solve_seconds: float = 0.0
    gap: Optional[float] = None
    message: str = ""
    predicted_cost: Optional[float] = None


Planner = Callable[[PlanGraph, int, PlanOptions], PlanResult]
_REGISTRY: Registry[Planner] = Registry("planner")


def register_planner(name: str) -> Callable[[Planner], Planner]:
    """Decorator: register ``plan(pg, budget, options) -> PlanResult`` as ``name``."""

    def wrap(fn: Planner) -> Planner:
        return _REGISTRY.add(name, fn)

    return wrap


def planner_names() -> List[str]:
    """The registered planners, in their reporting order."""
    return _REGISTRY.names()


def get_planner(name: str) -> Planner:
    """Look a planner up by name.

    Raises:
        ValueError: unknown name; the message lists the valid ones.
    """
    return _REGISTRY.get(name)


def run_planner(name: str, pg: PlanGraph, budget: int, options: Optional[PlanOptions] = None) -> PlanResult:
    """Run one planner and time it.

    Args:
        name: a registered planner.
        pg: the planning graph.
        budget: bytes (constants included).
        options: the knobs (defaults: :class:`PlanOptions`).

    Returns:
        The planner's result; ``infeasible`` without running it when the
        budget is below the memory every schedule needs
        (:func:`dtr.sim.planners.bounds.memory_lower_bound`); ``n/a`` when
        it needs a module that is not installed (scipy, for the ILPs).

    Raises:
        ValueError: unknown planner.
    """
    fn = get_planner(name)
    t0 = time.perf_counter()
    bound = memory_lower_bound(pg)
    if budget < bound.bytes:  # no schedule at all fits: no planner needs to search (Note [A memory lower bound])
        return PlanResult(name, "infeasible", None, time.perf_counter() - t0,
                          message=f"every schedule needs at least {bound.bytes} bytes, over the budget of "
                                  f"{int(budget)}: {bound.reason}")
    try:
        res = fn(pg, int(budget), options or PlanOptions())
    except ModuleNotFoundError as e:  # an optional dependency: the ILPs need scipy (the [planners] extra)
        return PlanResult(name, "n/a", None, time.perf_counter() - t0,
                          message=f"needs the module {e.name!r}: pip install 'dtr[planners]'")
    return replace(res, planner=name, solve_seconds=time.perf_counter() - t0)
