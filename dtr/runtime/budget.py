"""``dtr.budget``: run PyTorch code within a memory budget."""
from __future__ import annotations

import gc
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Union

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from dtr.core import Core, make_config
from dtr.errors import NestingError, OutOfBudgetError, ThrashingError
from dtr.heuristics import Heuristic, get_heuristic, heuristic_names
from dtr.runtime import entry as entries
from dtr.runtime.budget_args import check_device, limit_bytes
from dtr.runtime.costs import get_cost_model
from dtr.runtime.driver import Driver
from dtr.runtime.eager_stance import EagerStance
from dtr.runtime.escapes import patch_escapes
from dtr.runtime.failed_blocks import clear_own_frames, remember_left, settle_left
from dtr.runtime.native import key_active as _key_active
from dtr.runtime.native import use_entry, use_native
from dtr.runtime.recorder import LogRecorder, check_meta
from dtr.runtime.step_plans import PlanPolicy, StepPlans, plan_policy
from dtr.semantics import RUNTIME, check_thrash_limit
from dtr.sim.step_plan import StepPlan

__all__ = ["budget", "Budget", "active_budget", "check_device"]


# Note [Garbage collection during a block]
# The runtime allocates a few Python objects per op (recipes, slots, handles),
# so Python's cyclic GC runs during a block where plain PyTorch runs none, and
# a full collection scans every object of the process: about 180 ms with torch
# and a model loaded (285k objects), once every two or three TreeLSTM steps
# (about 20% of the step on average). The objects that exist when the block
# starts are therefore frozen (gc.freeze(): left out of collections) and
# unfrozen at its end; a full collection during the block then scans only what
# the block created (about 5 ms). Cyclic garbage among the frozen objects is
# collected after the block instead of during it. A program that froze objects
# itself (a fork server) is left alone: the block neither freezes nor unfreezes.

# See Note [Compiled code in a block] in dtr/runtime/eager_stance.py.


# Note [Nested blocks]
# Libraries open blocks inside their users' blocks: a trainer integration, a
# model's own memory-saving wrapper. Two cores over one program would each
# evict and recompute storages the other counts as resident, so an inner block
# (entered in the same thread while another is active) runs on the outer
# block's core and tables: the tighter of the two budgets binds while the inner
# block runs (and the tighter thrash limit), and the outer's come back when it
# ends. Each block has its own stats: the inner block's counters are those
# since it began (its peak too: the core's peak restarts at its entry and the
# outer's peak absorbs it at its exit). What the outer block fixed for the
# whole run cannot change inside it: its heuristic, cost model, device, per-op
# path and entry, its log. An inner block inherits them; one that asks for a
# different one (a value other than the default) raises NestingError, as does
# leaving blocks in another order than they were entered. The outer block
# alone brings back what the program holds at its end; an inner block leaves
# that to it.
_ACTIVE = threading.local()  # .stack: this thread's active blocks, outermost first

# The options an inner block inherits, with their defaults (budget()'s).
_INHERITED: Dict[str, Any] = {"heuristic": "eqclass", "log": None, "cost_model": "time", "sample": 0, "seed": 0,
                              "device": None, "log_meta": None, "eqclass_split": True, "native": None,
                              "entry": None, "plan": None}


def _active_blocks() -> List["Budget"]:
    stack = getattr(_ACTIVE, "stack", None)
    if stack is None:
        stack = _ACTIVE.stack = []
    return stack


def active_budget() -> Optional["Budget"]:
    """The innermost ``dtr.budget`` block active in this thread, or None.

    A library that opens its own block inside a user's can read the user's
    budget here (``active_budget().budget_bytes``) to choose its own.
    """
    stack = _active_blocks()
    return stack[-1] if stack else None


_STAT_COUNTERS = ("evictions", "eager_evictions", "remats", "base_compute", "remat_compute")


class Budget:
    """A memory budget for the code inside a ``with`` block (see :func:`budget`).

    Attributes:
        budget_bytes: the limit (None: no limit).
        native: whether the block runs the native per-op path (dtr/runtime/native.py).
        entry: how the block's ops should reach dtr: ``"mode"`` or ``"key"``.
        entered: how they did, once the block began (``"mode"`` where the key could not be taken).
        stats: a mapping readable during and after the block: ``evictions``,
            ``remats``, ``remat_seconds``, ``peak_bytes`` (dtr's accounting),
            ``budget_bytes``, ``memory_bytes``, ``base_compute``,
            ``remat_compute``, ``eager_evictions``, ``ops``. With
            ``cost_model="time"`` on CUDA, ``base_compute`` and ``remat_seconds``
            read during the block count only the op times the device has
            reported so far (the rest provisionally, or not yet); after the
            block they are complete.
    """

    def __init__(self, limit: Union[None, int, str], *, heuristic: Union[str, Heuristic] = "eqclass",
                 log: Optional[Union[str, os.PathLike]] = None, cost_model: str = "time",
                 thrash_limit: Optional[float] = 10.0, sample: int = 0, seed: int = 0,
                 device: Optional[Union[str, torch.device]] = None, log_meta: Optional[dict] = None,
                 eqclass_split: bool = True, native: Optional[bool] = None, entry: Optional[str] = None,
                 plan: Union[None, bool, str, float, PlanPolicy] = None):
        self.budget_bytes = limit_bytes(limit)
        policy = plan_policy(plan)
        if policy is not None and self.budget_bytes is None:
            raise ValueError("plan= needs a budget: without one nothing is evicted, so there is nothing to plan")
        if isinstance(heuristic, str):
            self.heuristic = get_heuristic(heuristic)
        elif isinstance(heuristic, Heuristic):
            self.heuristic = heuristic
        else:
            raise TypeError(f"heuristic must be a name ({', '.join(heuristic_names())}) or a dtr.Heuristic, "
                            f"not {heuristic!r}")
        self.cost_model = get_cost_model(cost_model)
        self.thrash_limit = check_thrash_limit(thrash_limit)  # math.inf: no limit
        self.log_path = log
        # Before any file is written: a log whose meta line the reader would refuse is refused whole.
        self.log_meta = check_meta(log_meta, reserved=("cost_unit", "budget_bytes", "heuristic", "recorded_by",
                                                       *RUNTIME.to_meta()))
        if not isinstance(eqclass_split, bool):
            raise TypeError(f"eqclass_split must be True or False, not {eqclass_split!r}")
        self.semantics = RUNTIME.replace(eqclass_split=eqclass_split)
        self._seed, self._sample = seed, sample
        make_config(self.heuristic, self.budget_bytes, semantics=self.semantics, seed=seed, sample=sample)  # checks
        self._device = check_device(device)
        if native is not None and not isinstance(native, bool):
            raise TypeError(f"native must be True, False or None, not {native!r}")
        self.native = use_native(native)  # which per-op path the block runs (dtr/runtime/native.py)
        if entry is not None and not isinstance(entry, str):
            raise TypeError(f"entry must be 'mode', 'key' or None, not {entry!r}")
        self.entry = use_entry(entry, self.native, self._device)  # how the block's ops reach it
        self.entered: Optional[str] = None  # how they did (dtr/runtime/entry.py)
        given = {"heuristic": heuristic, "log": log, "cost_model": cost_model, "sample": sample, "seed": seed,
                 "device": device, "log_meta": log_meta, "eqclass_split": eqclass_split, "native": native,
                 "entry": entry, "plan": plan}
        # What this block asks for, as it runs it (an inner block cannot change it: Note [Nested blocks]).
        effective = {"heuristic": self.heuristic.name, "log": log, "cost_model": self.cost_model.unit,
                     "sample": sample, "seed": seed, "device": self._device, "log_meta": log_meta,
                     "eqclass_split": eqclass_split, "native": self.native, "entry": self.entry, "plan": policy}
        self._asked = {k: effective[k] for k, v in given.items() if v is not _INHERITED[k] and v != _INHERITED[k]}
        self._runs = effective
        self._core: Optional[Core] = None
        self._driver: Optional[Driver] = None
        self._final: Optional[dict] = None
        self._froze = False
        self._ended_early = False  # ended when a block entered before it ended (Note [Blocks that end out of order])
        self._restore_escapes: Optional[Callable[[], None]] = None  # (set while a top-level block runs)
        self._stance: Optional[Any] = None
        self._outer: Optional["Budget"] = None  # the block this one is nested in (Note [Nested blocks])
        self._base: Dict[str, float] = {}       # the counters when a nested block began
        self._saved: tuple = ()                 # the outer block's budget, thrash limit and peak
        # A budget with a plan is entered once per step (Note [Planned steps] in step_plans.py).
        self._plans = None if policy is None or self.budget_bytes is None else StepPlans(policy, self.budget_bytes)
        self._busy = threading.Lock()  # held while a block of this budget runs (Note [One block at a time])

    @property
    def stats(self) -> dict:
        if self._final is not None:
            return dict(self._final)
        if self._core is None:
            return {"budget_bytes": self.budget_bytes}
        return self._read_stats()

    @property
    def step_stats(self) -> List[dict]:
        """With ``plan=``: each step's stats, with how it ran (``plan``: ``recorded``, ``planned``,
        ``diverged`` or ``online``), ``plan_ops`` (ops that matched the plan), ``plan_diverged_at`` (the
        first op that did not), ``planned_evictions`` and ``predicted_remat`` (the plan's recomputation, in
        ``cost_unit``: compare ``remat_compute``; with measured costs also ``predicted_remat_seconds``), and,
        for a step that followed its plan to the end with measured costs, ``op_time_ratio`` (its ops' time
        over the recorded step's) and ``expected_remat_seconds`` (the prediction at that speed, with
        ``remat_overhead_seconds`` for each recomputation the plan predicts: compare ``remat_seconds``).
        ``remat_overhead_seconds``: the runtime's own time per recomputation, estimated from the steps
        before. Empty without ``plan=``."""
        return [dict(s) for s in self._plans.steps] if self._plans is not None else []

    @property
    def plans(self) -> Dict[str, StepPlan]:
        """With ``plan=``: the plans kept, by step signature (:class:`dtr.sim.step_plan.StepPlan`)."""
        return dict(self._plans.plans) if self._plans is not None else {}

    @property
    def plan_errors(self) -> List[str]:
        """With ``plan=``: why recorded steps gave no plan (those steps' successors ran online)."""
        return list(self._plans.errors) if self._plans is not None else []

    def wait_for_plan(self, timeout: Optional[float] = None) -> bool:
        """With ``plan=``: wait until the step being planned has its plan (None: as long as it takes).

        Returns:
            Whether no planning is left in progress (True without ``plan=``).
        """
        return self._plans.wait(timeout) if self._plans is not None else True

    def close(self) -> None:
        """With ``plan=``: stop planning still in progress and remove its work files (the plans stay)."""
        if self._plans is not None:
            self._plans.close()

    def _read_stats(self) -> dict:
        assert self._core is not None and self._driver is not None, "only once the block has begun"
        c, base = self._core.counters, self._base  # (a nested block's: those since it began)
        stats = {
            "budget_bytes": self.budget_bytes,
            **{k: c[k] - base.get(k, 0) for k in _STAT_COUNTERS},
            "remat_seconds": self._driver.remat_seconds - base.get("remat_seconds", 0.0),
            "peak_bytes": c["peak_memory"],
            "memory_bytes": c["memory"],
            "cost_unit": self.cost_model.unit,
            "ops": self._driver.ops_seen - int(base.get("ops", 0)),
        }
        return {k: stats[k] for k in ("budget_bytes", "evictions", "eager_evictions", "remats", "remat_seconds",
                                      "peak_bytes", "memory_bytes", "base_compute", "remat_compute", "cost_unit",
                                      "ops")}

    def _check(self) -> None:
        """Assert the running block's invariants (Driver._check): tests call it between ops. O(its tables).

        Raises:
            AssertionError: one does not hold (a bug in dtr).
        """
        if self._core is not None and self._driver is not None:
            self._driver._check()

    # Note [One block at a time]
    # A budget object's block state (its core, driver, saved stance) is its
    # own, so one block of it runs at a time: entering it again while a block
    # of it runs (recursively, or from another thread) is refused, under a
    # lock, before anything changes. Before, two threads entering one plan=
    # budget overwrote each other's state, and every later block of either
    # thread failed. An enter that fails part way (a log file that cannot be
    # opened) undoes what it set, and the end of a block runs each of its
    # clean-up steps even when an earlier one is interrupted (a
    # KeyboardInterrupt), so a budget is never left unusable.
    def __enter__(self) -> "Budget":
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("this dtr.budget is in use: a block of it is running, in this thread or another. "
                               "A budget runs one block at a time: give each thread, and each nested block, a "
                               "dtr.budget of its own")
        final = self._final
        try:
            return self._enter()
        except BaseException:
            try:
                self._final = final  # (the last block's stats stay)
                if self._driver is not None and self._core is not None and self._outer is None:
                    self._undo_enter()
            finally:
                active = _active_blocks()
                if self in active:  # (see Note [An interrupted enter])
                    active.remove(self)
                self._core = self._driver = None
                self._busy.release()
            raise

    # Note [An interrupted enter]
    # A KeyboardInterrupt can land anywhere in an enter, also after the block took its mode or the key (or
    # inside entry.enter), froze the collector or joined the active blocks. An enter that raises gets no
    # __exit__: before, the mode or key stayed for good and every later block raised NestingError. The undo
    # gives the entry back whether or not entry.enter returned, unfreezes, and restores the core's hooks.
    def _undo_enter(self) -> None:
        """Undo what a top-level enter that failed part way set up (Note [One block at a time], Note [An
        interrupted enter])."""
        driver, core = self._driver, self._core
        assert driver is not None and core is not None
        try:
            entries.abandon(driver)
        finally:
            try:
                if self._restore_escapes is not None:
                    self._restore_escapes()
                if self._stance is not None:
                    self._stance.__exit__(None, None, None)
                if self._froze:
                    gc.unfreeze()
                if driver.recorder is not None:
                    driver.recorder.close()
            finally:
                core.set_hooks()
                driver.detach_native()

    def _enter(self) -> "Budget":
        if self._core is not None or (self._plans is None and self._final is not None):
            raise RuntimeError("a dtr.budget cannot be entered twice; create a new one (or give it plan=, "
                               "for one budget entered once per training step)")
        self._final, self._driver, self._restore_escapes, self._stance, self._outer = None, None, None, None, None
        self._froze = False
        active = _active_blocks()
        if active:
            return self._enter_nested(active[-1])
        if any(isinstance(m, entries.ModeEntry) for m in _get_current_dispatch_mode_stack()) or _key_active():
            # (a block of this thread's is always on its stack: this is a mode or key dtr did not enter)
            raise NestingError("a dtr runtime is already active in this thread outside any dtr.budget block")
        settle_left()  # see Note [A failed block leaves nothing to the next] in failed_blocks.py
        self._core = Core(self.heuristic, self.budget_bytes, semantics=self.semantics, seed=self._seed,
                          sample=self._sample, thrash_limit=self.thrash_limit)
        recorder = None
        log_path = self.log_path
        if self._plans is not None:  # (Note [Planned steps] in step_plans.py)
            record = self._plans.begin(self._core)
            log_path = log_path if log_path is not None or record is None else record
        if log_path is not None:  # the meta line records the semantics: a replay makes the same decisions
            recorder = LogRecorder(log_path, {
                **self.log_meta, "cost_unit": self.cost_model.unit, "budget_bytes": self.budget_bytes,
                "heuristic": self.heuristic.name, "recorded_by": "dtr.budget", **self.semantics.to_meta()})
        self._driver = Driver(self._core, self.cost_model, recorder, self._device)
        self._restore_escapes = patch_escapes(self._driver.escape, self._driver.resize, self._driver.escape_storage)
        # See Note [Compiled code in a block]: set now, and its __exit__ restores the old one (the last block's).
        self._stance = EagerStance()
        self.entered = entries.enter(self._driver, self.native, self.entry).kind
        # See Note [Garbage collection during a block].
        self._froze = gc.isenabled() and gc.get_freeze_count() == 0
        if self._froze:
            gc.freeze()
        active.append(self)
        return self

    def _enter_nested(self, outer: "Budget") -> "Budget":
        """Enter as a block inside ``outer`` (Note [Nested blocks]): its core, the tighter budget and limit."""
        clash = sorted(k for k, v in self._asked.items() if k == "log" or outer._runs[k] != v)
        if clash:
            asked = ", ".join(f"{k}={self._asked[k]!r}" for k in clash)
            raise NestingError(f"a dtr.budget block inside another runs on the outer block's runtime and cannot "
                               f"change {', '.join(clash)} (asked for {asked}); give an inner block only a budget "
                               f"and a thrash limit, or set these on the outer block")
        core, driver = outer._core, outer._driver
        assert core is not None and driver is not None, "an active block has a core"
        self.native, self.entry, self.entered, self._device = outer.native, outer.entry, outer.entered, outer._device
        self.heuristic, self.cost_model, self.semantics = outer.heuristic, outer.cost_model, outer.semantics
        outer_budget = None if core.budget < 0 else core.budget
        tighter = min((b for b in (outer_budget, self.budget_bytes) if b is not None), default=None)
        with driver.off():  # (what the program dropped is no longer resident; the tighter budget binds from now)
            driver.poll()
            self._saved = (outer_budget, core.thrash_limit, core.restart_peak())
            core.set_budget(tighter)
            try:
                core.fit_budget()
            except BaseException:
                core.set_budget(outer_budget)
                core.raise_peak(self._saved[2])
                raise
        core.set_thrash_limit(min(core.thrash_limit, self.thrash_limit))
        c = core.counters
        self._base = {**{k: c[k] for k in _STAT_COUNTERS}, "remat_seconds": driver.remat_seconds,
                      "ops": driver.ops_seen}
        self._outer, self._core, self._driver = outer, core, driver
        _active_blocks().append(self)
        return self

    def _exit_nested(self) -> None:
        """Leave a nested block: its stats, and the outer block's budget, thrash limit and peak again."""
        core = self._core
        assert core is not None
        try:
            self._final = self._read_stats()
        finally:
            outer_budget, outer_limit, outer_peak = self._saved
            try:
                core.set_budget(outer_budget)
                core.set_thrash_limit(outer_limit)
                core.raise_peak(outer_peak)
            finally:
                self._core = None

    # Note [An interrupted end]
    # An interrupt can land anywhere in __exit__ after the block left the active blocks: before finish(), it
    # skipped the bring-back (tensors the program holds read 0 bytes) and left the mode or key taken. The
    # entry is given back and finish() runs (its errors then give way to the interrupt) whatever came before.
    # Note [Blocks that end out of order]
    # Two generators (or coroutines) that each hold a block across a yield,
    # interleaved in one thread, end their blocks out of order. Before, the
    # one that ended first got a NestingError and its block stayed active for
    # the rest of the process: nothing could end it any more, later blocks
    # nested in it, and code outside any block ran under its budget. Now the
    # blocks entered after it are ended first (each brings back what the
    # program holds and restores what it set, as a failed block does), then
    # this one, and the NestingError says so; a block ended that way says so
    # again when its own `with` ends. A block active in another thread is not
    # this thread's to end.
    def __exit__(self, exc_type, exc, tb) -> None:
        driver, core = self._driver, self._core
        if driver is None or core is None:
            if self._ended_early:
                self._ended_early = False
                raise NestingError("this dtr.budget block was already ended: a block entered before it ended "
                                   "first, and blocks end in the reverse order they began (a generator or "
                                   "coroutine suspended inside a block?)")
            raise RuntimeError("dtr.budget.__exit__: this block is not active (__exit__ without a matching "
                               "__enter__, or called twice); use `with budget:`")
        active = _active_blocks()
        if self not in active:
            raise NestingError("this dtr.budget block is active in another thread: a block ends in the thread "
                               "that entered it")
        if active[-1] is not self:  # see Note [Blocks that end out of order]
            later = active[active.index(self) + 1:]
            why = NestingError("dtr.budget blocks must end in the reverse order they began: a block entered "
                               "before this one ended first, and ended it")
            for inner in reversed(later):
                try:
                    inner.__exit__(NestingError, why, None)
                finally:
                    inner._ended_early = True
            try:
                self.__exit__(exc_type, exc, tb)
            finally:
                raise NestingError(f"dtr.budget blocks must end in the reverse order they began: this block "
                                   f"ended while {len(later)} block(s) entered after it were active (a generator "
                                   f"or coroutine suspended inside a block?); they were ended first, and each "
                                   f"says so when its own `with` ends")
        # (no call before the try: an interrupt lands only at calls, and from here on it still ends the block)
        restore, stance, failed, budget_error = self._restore_escapes, self._stance, exc is not None, False
        if self._outer is not None:
            try:
                active.pop()
                self._exit_nested()
            finally:
                if self in active:
                    active.remove(self)
                self._busy.release()
            return None
        prepared = False  # (an interrupt before finish() still brings everything back: Note [An interrupted end])
        try:
            try:
                try:
                    active.pop()
                    assert restore is not None and stance is not None, "a top-level block restores what it set"
                    budget_error = isinstance(exc, (OutOfBudgetError, ThrashingError))
                    if exc is not None:
                        clear_own_frames(exc)  # see Note [Nothing of a failed block stays alive] in failed_blocks.py
                finally:
                    try:
                        if restore is not None:
                            restore()
                    finally:
                        entries.abandon(driver, keep=True)
                prepared = True
            finally:
                # Every tensor the program holds is resident again (entry.py's Note [Where dtr's own work runs]).
                with driver.off():
                    if exc_type is None and prepared:
                        try:
                            driver.finish()
                        except BaseException as e:
                            failed, budget_error = True, isinstance(e, (OutOfBudgetError, ThrashingError))
                            raise
                    else:  # (see Note [The end of a block] in driver.py; the block's own exception goes on)
                        failed = True
                        try:
                            driver.finish()
                        except (OutOfBudgetError, ThrashingError):
                            pass  # everything came back; the block's own exception is the one to see
                        except Exception:
                            pass  # (finish warned: Note [The end of a block] in driver.py)
        finally:  # (each step runs even if one before it is interrupted: Note [One block at a time])
            try:
                if stance is not None:
                    stance.__exit__(None, None, None)
                if self._froze:
                    gc.unfreeze()
                added = driver.carry_out()  # see Note [Constants from earlier blocks] in driver.py (failed too)
                if failed:  # what it left may be garbage the next block must not count
                    remember_left(added)
                self._final = self._read_stats()
                if driver.recorder is not None:
                    driver.recorder.close()
                if self._plans is not None:
                    log = None if self.log_path is None else os.fspath(self.log_path)
                    self._final.update(self._plans.end(core, self._final, failed, log, budget_error))
            finally:
                try:
                    core.set_hooks()
                    driver.detach_native()
                finally:
                    if self in active:
                        active.remove(self)
                    driver.entry = None
                    # Drop dtr's references: recipes, buffers, the core.
                    driver.recomputer.recipes.clear()
                    driver.table.clear()
                    self._core = None
                    self._busy.release()
        return None


def budget(limit: Union[None, int, str], *, heuristic: Union[str, Heuristic] = "eqclass",
           log: Optional[Union[str, os.PathLike]] = None, cost_model: str = "time",
           thrash_limit: Optional[float] = 10.0, sample: int = 0, seed: int = 0,
           device: Optional[Union[str, torch.device]] = None, log_meta: Optional[dict] = None,
           eqclass_split: bool = True, native: Optional[bool] = None, entry: Optional[str] = None,
           plan: Union[None, bool, str, float, PlanPolicy] = None) -> Budget:
    """Run the code in a ``with`` block within ``limit`` bytes of tensor memory.

    Every tensor storage the block touches on the device counts (parameters,
    inputs, activations, gradients, optimizer state); tensors that existed
    before the block are constants (counted, never evicted), from the first op
    that touches them, or from the block's first op if an earlier block on the
    device saw the program hold them at its end and they are still alive: like
    a device memory cap, a step's forward counts the gradients of the last step.
    When an op would exceed the budget, dtr evicts the storages the heuristic
    ranks cheapest and recomputes them when they are needed again.

    Blocks nest: a block entered inside another (in the same thread) runs on
    the outer block's runtime, the tighter of the two budgets binds while it
    runs, and it has stats of its own (Note [Nested blocks]).

    ``torch.compile``: inside the block, compiled functions run their ops
    eagerly (the block sets the ``"force_eager"`` compiler stance, and
    restores the program's at its end), so dtr tracks them and results equal
    eager PyTorch's; the compilation's speed-up is lost there. dtr does not
    let compiled kernels run unseen: they read their inputs by raw pointer, so an input dtr had
    evicted would be read as freed memory (docs/design.md).

    Args:
        limit: bytes, a string such as ``"6GiB"`` or ``"500MB"`` (KiB/MiB/GiB
            1024-based, KB/MB/GB 1000-based), or None (no limit: track and
            record). A number of 2**63 bytes or more (``float("inf")``) is no limit too.
        heuristic: a registered heuristic name (``eqclass``, ``dtr``, ``local``,
            ``lru``, ``largest``, ``random``, ``eqclass-split``) or a :class:`dtr.Heuristic`.
        log: write the block's ops as a v1 log to this path (``.gz`` compresses).
        cost_model: ``"time"`` (measured op times, ns; on CUDA by events,
            without a synchronization per op: see dtr/runtime/timing.py) or
            ``"flops"`` (deterministic; decisions are then reproducible and replayable).
        thrash_limit: raise :class:`dtr.ThrashingError` once recomputation
            passes ``thrash_limit - 1`` times the block's own compute so far, or
            the number of recomputations passes ``thrash_limit - 1`` times the
            number of ops it computed (ops that cost nothing count too): a
            number >= 1 (1: no recomputation at all), or None for no limit.
        sample: score only this many random pool members per eviction (0: all).
        seed: seed of the ``random`` heuristic and of sampling.
        device: the device whose memory is budgeted (default: that of the first
            tensor seen).
        log_meta: extra JSON fields for the log's meta line (e.g. ``model``,
            ``batch``: the simulator's figures name them).
        eqclass_split: with ``eqclass``, split an evicted-neighbourhood
            component exactly when a storage in it comes back (the core's Note
            [Splitting eqclass components]); False gives simrd's eqclass, which
            only subtracts that storage's cost. Recorded in the log's meta line,
            so that a replay makes the same decisions.
        native: run each op's bookkeeping in C++ (``dtr._native``) where
            it applies (True), or always in the Python reference (False); the
            two make the same decisions. None: ``$DTR_NATIVE`` (``0``: the
            reference), else native wherever it is built for this torch (where
            it is not, a warning says why, once, and the reference runs).
        entry: how the block's ops reach dtr. ``"mode"``: a
            TorchDispatchMode (every op into Python and back). ``"key"``: a C++
            fallback on a dispatch key below autograd, which costs far less host
            time per op (dtr._native; where it is not built, ``"mode"``). The op
            stream differs slightly (autograd accumulates gradients in place
            when no Python objects hold them), the results do not. Python modes
            of the program see ops before dtr. None: ``$DTR_ENTRY``, else
            ``"key"`` for a native block on the CPU (``device``, or where torch
            sees no accelerator) and ``"mode"`` elsewhere: the key has not been
            validated on CUDA yet (Note [The default entry] in
            dtr/runtime/native.py).
        plan: plan the steps of a training loop with the future known
            (Note [Planned steps] in dtr/runtime/step_plans.py): the budget is
            then one object entered once per step (``with mem: step()``); the
            first step is recorded and planned off the critical path, later
            ones follow the plan until an op differs, then go on online.
            ``True``: the default planner (``auto``) and time limit (30 s); a
            planner's name; a time limit in seconds; or a
            :class:`dtr.runtime.step_plans.PlanPolicy`. Per-step figures:
            ``step_stats``. Needs a budget.

    Returns:
        A :class:`Budget`; ``with dtr.budget(...) as b: ...`` then ``b.stats``.

    Raises:
        dtr.OutOfBudgetError: (inside the block) no eviction can make room;
            names the budget, the memory needed, the op about to run and what
            filled the budget (``.report``: every storage dtr could not evict
            and why; :class:`dtr.budget_report.BudgetReport`).
        dtr.ThrashingError: (inside the block) recomputation passed the
            thrash limit, in compute or in count.
        dtr.errors.BudgetError: ``limit`` is not a size.
        TypeError, ValueError: another argument is invalid (an unknown
            heuristic or cost model names the valid ones; a device this torch
            cannot use; ``log_meta`` that is not JSON); nothing is written.
        dtr.errors.NestingError: (on entering) the block is inside another
            ``dtr.budget`` block and asks for something only the outer block
            sets (a heuristic, cost model, device, per-op path, entry or log
            of its own); or (on leaving) blocks ended out of order. Nested
            blocks otherwise work: the tighter budget binds inside, and each
            block has its own stats (Note [Nested blocks]).
    """
    return Budget(limit, heuristic=heuristic, log=log, cost_model=cost_model, thrash_limit=thrash_limit,
                  sample=sample, seed=seed, device=device, log_meta=log_meta, eqclass_split=eqclass_split,
                  native=native, entry=entry, plan=plan)
