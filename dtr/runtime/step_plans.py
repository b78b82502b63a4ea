"""Planned steps: ``dtr.budget(B, plan=True)`` records a step, plans it with the future known, follows the plan.

One :class:`StepPlans` belongs to one reusable :class:`~dtr.runtime.budget.Budget`;
each ``with`` block is a step. See Note [Planned steps].
"""
from __future__ import annotations

import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import weakref
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Union

from dtr.core import Core
from dtr.errors import DtrError
from dtr.sim.planners import planner_names
from dtr.sim.step_plan import AUTO, DEFAULT_PLANNER, StepPlan, load_step_plan, make_step_plan, step_signature

__all__ = ["PlanPolicy", "StepPlans", "plan_policy", "BACKGROUNDS"]

_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}  # a measured cost unit -> seconds
#: The recent steps whose recomputations estimate the runtime's own cost of one (Note [The runtime's cost of
#: a recomputation]).
OVERHEAD_STEPS = 8
#: Signatures whose successor is remembered (Note [Planned steps]); past it the memory starts again.
_MAX_FOLLOWS = 4096

#: How planning runs: in a process of its own (the default), a thread, or at the block's end.
BACKGROUNDS = ("process", "thread", "inline")

# Note [Planned steps]
# ~~~~~~~~~~~~~~~~~~~~
# A training loop runs one step shape again and again. With plan=, the budget
# object is reused for every step (``with mem:``) and:
# - every step fingerprints its ops (Note [Following a plan] in
#   csrc/core_follow.cpp); its *signature* digests them (step_signature), so
#   two steps of the same ops and shapes share one;
# - the first step runs online and is recorded as a log. Planning it
#   (dtr.sim.step_plan.make_step_plan) runs off the step's critical path
#   (Note [Planning off the critical path]); the plan is kept only if the
#   core, replaying the recorded step while following it, finishes within the
#   budget and recomputes less than online DTR does there;
# - each later step is expected to have the signature that followed the
#   previous step's signature the last time it was seen, or else the
#   previous step's own (steps repeat; a loop that alternates between two
#   shapes, A B A B, expects A after B); it follows the plan of that
#   signature, or else the newest plan, unless that signature was planned
#   and found no better than online (then it runs online). (Expecting the
#   previous step's own signature, the A B loop recorded A again and again
#   and never planned B.) The core matches op by op; at the first
#   op that differs (a new sequence length, the last short batch, a dynamic
#   model) the rest of the step runs online. Nothing else changes: values
#   are exact, the budget binds, a plan only chooses evictions;
# - a step expected to have a signature seen ``repeat`` times with no plan
#   (it keeps coming back) is recorded and planned; so is the second step's, if it differs
#   from the first's: a loop's first step is often its own (an optimizer
#   creates its state; the parameters and gradients the first step leaves
#   are constants of every later one from their first op on: Note
#   [Constants from earlier blocks] in driver.py), so the third step is
#   recorded and the fourth follows a plan of the steady state. A signature
#   planned once and found no better than online is not planned again. So a
#   model whose every step differs (a TreeLSTM over new trees) records and
#   plans two steps only, and then pays only the fingerprints;
# - at most ``max_plans`` plans are kept, the least recently used dropped;
# - with measured costs, a planned step whose measured recomputation time
#   strays from the plan's prediction at the step's op speed (Note [A plan's
#   prediction at the step's speed]) by more than ``drift`` (a fraction)
#   three steps running is recorded and planned again;
# - a step that starts with more bytes resident than the recorded one did
#   (beyond a margin) does not follow its plan: it diverges at its first op
#   and runs online (Note [A step that starts with more] in
#   csrc/core_follow.cpp). That is the common case of an optimizer inside the
#   block: the first step creates its state, which every later step holds
#   from its first op, and whose room the first step's plan spent. A step of
#   the plan's own signature that starts so drops the plan, and the steps are
#   recorded and planned again from their new start;
# - a step that ran out of budget (or thrashed) after following any of its
#   plan drops that plan: the plan was checked against the recorded step
#   only, and what it evicted may leave a step that differs (or starts with
#   more) nothing online can do (a loop following a plan in part ran out of
#   budget in every step where online DTR fitted each). Its signature is
#   recorded again from the next step on and planned from that (the failed
#   step's error goes to the program, as online DTR's would; plan_errors
#   says why the plan went);
# - a recorded step whose signature turns out to have a plan already, or to
#   have been found no better than online, is not planned again, and closing
#   the budget while a step is planned lets that signature be planned later.


@dataclass(frozen=True)
class PlanPolicy:
    """How a budget plans its steps (``dtr.budget(B, plan=...)``).

    Attributes:
        planner: a registered planner or ``auto`` (dtr.sim.step_plan.AUTO_PLANNERS).
        time_limit: seconds the planners may take for one step, in all.
        background: one of :data:`BACKGROUNDS`.
        max_plans: plans kept, one per step signature.
        repeat: a signature seen this many times without a plan is recorded again.
        drift: the measured recomputation's tolerated relative distance from the prediction.
    """

    planner: str = DEFAULT_PLANNER
    time_limit: float = 30.0
    background: str = "process"
    max_plans: int = 4
    repeat: int = 2
    drift: float = 0.5


def plan_policy(plan: Union[None, bool, str, float, PlanPolicy]) -> Optional[PlanPolicy]:
    """The policy ``plan=`` asks for: None/False none, True the default, a planner's name, a time limit.

    Raises:
        ValueError: an unknown planner or background; a time limit or drift that is not a positive number, or
            max_plans or repeat that is not a whole number of at least 1 (the message names the field).
        TypeError: a value of another type.
    """
    if plan is None or plan is False:
        return None
    if plan is True:
        policy = PlanPolicy()
    elif isinstance(plan, PlanPolicy):
        policy = plan
    elif isinstance(plan, str):
        policy = PlanPolicy(planner=plan)
    elif isinstance(plan, (int, float)) and not isinstance(plan, bool):
        policy = PlanPolicy(time_limit=float(plan))
    else:
        raise TypeError(f"plan must be True, a planner's name, a time limit in seconds or a "
                        f"dtr.runtime.step_plans.PlanPolicy, not {plan!r}")
    from_registry = planner_names()
    if policy.planner != AUTO and policy.planner not in from_registry:
        raise ValueError(f"unknown planner {policy.planner!r}; the planners are: {AUTO}, {', '.join(from_registry)}")
    if policy.background not in BACKGROUNDS:
        raise ValueError(f"unknown background {policy.background!r}; valid: {', '.join(BACKGROUNDS)}")
    for name in ("time_limit", "drift"):
        v = getattr(policy, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            unit = " of seconds" if name == "time_limit" else ""
            raise ValueError(f"PlanPolicy.{name} must be a positive number{unit}, not {v!r}")
    for name in ("max_plans", "repeat"):
        v = getattr(policy, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"PlanPolicy.{name} must be a whole number of at least 1, not {v!r}")
    return policy


# Note [A plan's prediction at the step's speed]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# With measured costs a plan predicts its recomputation in the recorded
# step's op times. A later step's ops run faster or slower as a whole (a
# shared machine, clocks, another process): on the 2-core CPU the same ops of
# one GPT step took 0.95-1.20x the recorded step's time from step to step, and
# the recomputations in a step moved with them. That is not the plan's error,
# and re-planning would not help: the same plan stays the best. So a step that
# followed its plan to the end also reports ``op_time_ratio`` (its own ops'
# measured time, first computations only, over the recorded step's) and
# ``expected_remat_seconds`` (the prediction times that ratio), and the drift
# rule compares the measured recomputation with the latter: a plan is made
# again when its ops' times change relative to each other, not when the
# machine's speed does.


def _at_step_speed(plan: Optional[StepPlan], stats: Dict[str, Any], overhead: float) -> Dict[str, Optional[float]]:
    """A planned step's op-time ratio to its recorded step, and the plan's prediction scaled by it.

    Args:
        plan: the plan the step followed to its end (None: it did not).
        stats: the step's stats (``base_compute``: its ops' first computations, in ``cost_unit``).
        overhead: the runtime's own seconds per recomputation, as estimated before the step (Note [The
            runtime's cost of a recomputation]).

    Returns:
        ``op_time_ratio`` and ``expected_remat_seconds`` (the plan's recomputations at the step's op speed,
        and the overhead for each), None where costs are not times or the step did not follow a plan (Note
        [A plan's prediction at the step's speed]).
    """
    unit = _SECONDS.get(plan.cost_unit) if plan is not None else None
    if plan is None or unit is None or plan.base_compute <= 0 or stats.get("cost_unit") != plan.cost_unit:
        return {"op_time_ratio": None, "expected_remat_seconds": None}
    ratio = stats.get("base_compute", 0.0) / plan.base_compute
    return {"op_time_ratio": ratio,
            "expected_remat_seconds": plan.predicted_remat * unit * ratio + plan.predicted_remats * overhead}


# Note [The runtime's cost of a recomputation]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A recomputation costs its op's time and the runtime's own work around it
# (Note [The cost of a recomputation] in dtr/sim/step_plan.py). With measured
# costs, every step with recomputations tells that work apart: its
# ``remat_seconds`` (timed around each whole recomputation) less its
# ``remat_compute`` (the ops' costs the core knows, this step's own times),
# per recomputation. The estimate is the median over the last OVERHEAD_STEPS
# such steps, never below 0 (on CUDA both are device times, and the host's
# work mostly hides). Plans are made charging it per recomputation, and a
# planned step's ``expected_remat_seconds`` adds it per recomputation the
# plan predicts, at the estimate from before the step.



class _Job:
    """One step being planned: a process, a thread, or a plan made already."""

    def __init__(self, policy: PlanPolicy, log: str, budget: int, workdir: str, overhead: float = 0.0):
        self.log, self.out = log, os.path.join(workdir, os.path.basename(log) + ".plan.json")
        self.plan: Optional[StepPlan] = None
        self.error: Optional[str] = None
        self.proc: Optional[subprocess.Popen] = None
        self.thread: Optional[threading.Thread] = None
        self.overhead = overhead  # (the log's cost unit: Note [The cost of a recomputation])
        args = [log, str(budget), policy.planner, repr(policy.time_limit), repr(overhead)]
        if policy.background == "process":
            # (no multiprocessing: a spawned child would import the user's __main__ again)
            self.proc = subprocess.Popen([sys.executable, "-m", "dtr.sim.plan_worker", *args, self.out],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=workdir)
        elif policy.background == "thread":
            # Not a daemon: a daemon thread still inside the planner's C++ when the interpreter shuts down is
            # killed as it takes the GIL back (std::terminate: SIGABRT at exit); planning ends by its time limit.
            self.thread = threading.Thread(target=self._plan_here, args=(budget, policy), daemon=False)
            self.thread.start()
        else:
            self._plan_here(budget, policy)

    def _plan_here(self, budget: int, policy: PlanPolicy) -> None:
        try:
            self.plan = make_step_plan(self.log, budget, policy.planner, time_limit=policy.time_limit,
                                       later_steps=True, remat_overhead=self.overhead)
        except (DtrError, ValueError, OSError) as e:
            self.error = str(e)

    def done(self, wait: Optional[float] = 0.0) -> bool:
        """Whether it finished (waiting up to ``wait`` seconds; None: as long as it takes)."""
        if self.proc is not None:
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                return False
            if self.plan is None and self.error is None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                if self.proc.returncode == 0:
                    try:
                        self.plan = load_step_plan(self.out)
                    except DtrError as e:
                        self.error = str(e)
                else:
                    self.error = err.strip() or f"the planner exited with status {self.proc.returncode}"
            return True
        if self.thread is not None:
            self.thread.join(wait)
            return not self.thread.is_alive()
        return True


class StepPlans:
    """The plans of one reusable budget, and what each step did (Note [Planned steps]).

    Args:
        policy: how to plan.
        budget_bytes: the budget the plans are made for.
    """

    def __init__(self, policy: PlanPolicy, budget_bytes: int):
        self.policy = policy
        self.budget_bytes = budget_bytes
        self.plans: "OrderedDict[str, StepPlan]" = OrderedDict()
        self.seen: Counter = Counter()
        self.tried: set = set()          # signatures planned once (a plan kept or not)
        self.steps: List[Dict[str, Any]] = []
        self.errors: List[str] = []      # planning failures (the steps ran online)
        self._last: Optional[str] = None
        self._follows: Dict[str, str] = {}  # signature -> the one that came after it last time
        self._job: Optional[_Job] = None
        self._job_signature: Optional[str] = None
        self._dir = tempfile.mkdtemp(prefix="dtr-plans-")
        self._procs: List[subprocess.Popen] = []  # (for the finalizer: it must not hold self)
        self._finalize = weakref.finalize(self, _clean_up, self._dir, self._procs)
        self._current: Optional[StepPlan] = None
        self._recording: Optional[str] = None
        self._drifted = 0
        self._overheads: Deque[float] = deque(maxlen=OVERHEAD_STEPS)

    @property
    def remat_overhead_seconds(self) -> float:
        """The runtime's own seconds per recomputation, from recent steps (Note [The runtime's cost of a
        recomputation]); 0 before any step with measured recomputations."""
        return statistics.median(self._overheads) if self._overheads else 0.0

    def _observe_overhead(self, stats: Dict[str, Any]) -> None:
        """Add a step's own seconds per recomputation to the estimate (Note [The runtime's cost of a
        recomputation]): its recomputation time beyond its ops' costs; nothing without measured ones."""
        unit = _SECONDS.get(stats.get("cost_unit", ""))
        remats = stats.get("remats", 0)
        if unit is not None and remats:
            beyond = stats.get("remat_seconds", 0.0) - stats.get("remat_compute", 0.0) * unit
            self._overheads.append(max(0.0, beyond / remats))

    def begin(self, core: Core) -> Optional[str]:
        """Prepare a new step's core (before its first op): the plan to follow, fingerprints.

        Returns:
            A path to record the step's log to, or None.
        """
        self._collect(wait=0.0)
        nxt = self._expected()
        plan = self.plans.get(nxt) if nxt is not None else None
        if plan is None and self.plans and nxt not in self.tried:  # (a step like one found no better
            plan = next(reversed(self.plans.values()))             # than online runs online)
        self._current = plan
        if plan is not None:
            self.plans.move_to_end(plan.signature)
            core.set_plan(plan.follow_plan())
        core.record_fingerprints(True)
        self._recording = None
        if self._job is None and self._wants_record(nxt):
            self._recording = os.path.join(self._workdir(), f"step{len(self.steps)}.jsonl")
        return self._recording

    def _expected(self) -> Optional[str]:
        """The signature the next step is expected to have: the one that followed the last step's signature
        the last time it was seen, else the last step's own (Note [Planned steps]: a loop that alternates
        between shapes gets a plan for each)."""
        return None if self._last is None else self._follows.get(self._last, self._last)

    def _wants_record(self, nxt: Optional[str]) -> bool:
        if not self.steps:
            return True
        if nxt is None or nxt in self.plans or nxt in self.tried:
            return False
        # (the second step differs from the first more often than not: Note [Planned steps])
        return self.seen[nxt] >= self.policy.repeat or len(self.steps) == 2

    def _workdir(self) -> str:
        """The work directory for recorded steps and plans, made again after :meth:`close`."""
        if not os.path.isdir(self._dir):
            self._dir = tempfile.mkdtemp(prefix="dtr-plans-")
            self._procs = []
            self._finalize = weakref.finalize(self, _clean_up, self._dir, self._procs)
        return self._dir

    def end(self, core: Core, stats: Dict[str, Any], failed: bool, log: Optional[str] = None,
            out_of_budget: bool = False) -> Dict[str, Any]:
        """Close a step: its signature, what it followed, and planning what it recorded.

        Args:
            core: the step's core.
            stats: the block's stats.
            failed: whether the block raised.
            log: where the step's log was written, when the user asked for one (a copy is planned).
            out_of_budget: whether it raised OutOfBudgetError or ThrashingError (Note [Planned steps]).

        Returns:
            The step's plan fields (added to the block's stats).
        """
        sig = step_signature(core.fingerprints())
        followed, diverged, length = core.plan_state
        plan = self._current
        counters = core.counters
        if self._recording is not None:
            mode = "recorded"
        elif plan is None:
            mode = "online"
        elif diverged < 0 and followed == length:
            mode = "planned"
        else:
            mode = "diverged"
        overhead = self.remat_overhead_seconds
        self._observe_overhead(stats)
        fields = {"plan": mode, "plan_signature": sig, "planner": plan.planner if plan else None,
                  "plan_ops": followed if plan else 0,
                  # (a step that ended, or failed, before the plan's end diverged where it stopped)
                  "plan_diverged_at": diverged if plan and diverged >= 0 else followed if mode == "diverged" else None,
                  "planned_evictions": counters["planned_evictions"],
                  "start_bytes": core.start_memory,
                  "predicted_remat": plan.predicted_remat if plan else None,
                  "predicted_remat_seconds": plan.predicted_remat * _SECONDS[plan.cost_unit]
                  if plan and plan.cost_unit in _SECONDS else None,
                  "remat_overhead_seconds": overhead,
                  **_at_step_speed(plan if mode == "planned" else None, stats, overhead)}
        if not failed:  # (a failed step stopped short: its signature is no step shape of the loop)
            self.seen[sig] += 1
            if self._last is not None:
                if len(self._follows) >= _MAX_FOLLOWS and self._last not in self._follows:
                    self._follows.clear()  # (a loop whose every step differs: bounded)
                self._follows[self._last] = sig
            self._last = sig
        if mode == "planned" and plan is not None:
            self._check_drift(plan, stats, fields["expected_remat_seconds"])
        if plan is not None and out_of_budget and diverged != 0:  # (see Note [Planned steps])
            where = f"at op {followed} of {length}" if diverged < 0 else f"after it diverged at op {diverged}"
            self._drop(plan, f"ran out of budget {where}")
        elif plan is not None and diverged == 0 and sig == plan.signature and not failed:
            self._drop(plan, f"was made for a step that starts with {plan.start_bytes} bytes resident; this one "
                             f"started with {core.start_memory}")
        if self._recording is not None:
            if log is not None and not failed:
                shutil.copyfile(log, self._recording + (".gz" if log.endswith(".gz") else ""))
                self._recording += ".gz" if log.endswith(".gz") else ""
            if failed or sig in self.plans or sig in self.tried:  # (a step like one planned already)
                _remove(self._recording)
            else:
                self.tried.add(sig)
                self._job_signature = sig
                unit = _SECONDS.get(stats.get("cost_unit", ""))
                charge = self.remat_overhead_seconds / unit if unit else 0.0
                self._job = _Job(self.policy, self._recording, self.budget_bytes, self._workdir(), charge)
                if self._job.proc is not None:
                    self._procs[:] = [self._job.proc]
                if self.policy.background == "inline":
                    self._collect(wait=None)
            self._recording = None
        self.steps.append({**stats, **fields})
        return fields

    def _drop(self, plan: StepPlan, why: str) -> None:
        """Drop a plan that failed its steps; its signature is recorded and planned again (Note [Planned steps])."""
        self.plans.pop(plan.signature, None)
        self.tried.discard(plan.signature)
        self.seen[plan.signature] = max(self.seen[plan.signature], self.policy.repeat)
        self.errors.append(f"the plan for {plan.signature} ({plan.planner}) {why}; it was dropped, and the steps "
                           f"are recorded and planned again")

    def _check_drift(self, plan: StepPlan, stats: Dict[str, Any], expected: Optional[float]) -> None:
        """Re-plan a signature whose measured recomputation keeps straying from the plan (Note [Planned steps]).

        Args:
            plan: the plan the step followed to its end.
            stats: the step's stats.
            expected: the plan's recomputation at the step's op speed, seconds (Note [A plan's
                prediction at the step's speed]); None: with costs that are not times.
        """
        if expected is None or expected <= 0:
            return
        measured = stats.get("remat_seconds", 0.0)
        if abs(measured - expected) > self.policy.drift * expected:
            self._drifted += 1
        else:
            self._drifted = 0
        if self._drifted >= 3:
            self._drifted = 0
            self.plans.pop(plan.signature, None)
            self.tried.discard(plan.signature)
            self.seen[plan.signature] = self.policy.repeat

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait for the step being planned (None: as long as it takes). Returns whether none is left."""
        self._collect(wait=timeout)
        return self._job is None

    def _collect(self, wait: Optional[float]) -> None:
        job = self._job
        if job is None or not job.done(wait):
            return
        self._job = None
        _remove(job.log)
        _remove(job.out)
        if job.error is not None:
            self.errors.append(job.error)
            return
        plan = job.plan
        if plan is not None and plan.ok:
            self.plans[plan.signature] = plan
            while len(self.plans) > self.policy.max_plans:
                self.plans.popitem(last=False)
        elif plan is not None:
            self.errors.append(f"no plan ({plan.status}): {plan.message}")

    def close(self) -> None:
        """Stop a planning process still running and remove the work files (also when garbage-collected)."""
        if self._job is not None:  # (its signature was never planned: it may be, later)
            self.tried.discard(self._job_signature)
        self._job = None
        self._finalize()


def _clean_up(workdir: str, procs: List[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    shutil.rmtree(workdir, ignore_errors=True)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
