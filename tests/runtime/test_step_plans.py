"""Planned steps: dtr.budget(B, plan=...) records a step, plans it, follows the plan exactly, falls back online."""
from __future__ import annotations

import contextlib
import gc
import os
import random
import statistics
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from support.hf import hf_train
from support.models import TinyGPT, TreeLSTM, cnn, mlp, random_tree
from support.paths import child_env
from support.training import assert_same_state, budget_at, constant_bytes, grads_of, peak_of

import dtr
from dtr.core import Core
from dtr.errors import NestingError
from dtr.runtime.step_plans import PlanPolicy
from dtr.sim import read_log
from dtr.sim.replay import replay
from dtr.sim.step_plan import log_fingerprints, step_signature

INLINE = PlanPolicy(background="inline", time_limit=6)


def _case(name: str):
    """A model, its step and a budget at which a plan recomputes less than online DTR (found by measuring)."""
    torch.manual_seed(0)
    if name == "mlp":  # Linear-ReLU-Dropout: random ops, recomputed bit-exactly
        m = mlp(256, 6)
        x, y = torch.randn(256, 256), torch.randint(0, 10, (256,))

        def loss(batch=x, target=y):
            return F.cross_entropy(m(batch), target)
    else:  # BatchNorm, in-place ReLU, residual +=
        m = cnn(16, 3)
        x = torch.randn(8, 3, 32, 32)

        def loss(batch=x, target=None):
            return m(batch).pow(2).mean()

    def step(*args):
        torch.manual_seed(1)
        m.zero_grad(set_to_none=True)
        out = loss(*args)
        out.backward()
        return out.detach()

    return m, x, step


def _mlp_at_half():
    """The mlp case, fresh, and the budget at half its step's peak above its constants."""
    m, x, step = _case("mlp")
    b = budget_at(constant_bytes(m, x), peak_of(step), 0.5)
    return (*_case("mlp"), b)


def _plain_grads(name: str, steps: int):
    m, _, step = _case(name)
    out = []
    for _ in range(steps):
        step()
        out.append(grads_of(m))
    return out


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_planned_steps_are_exact_and_recompute_what_the_plan_predicts(name):
    want = _plain_grads(name, 4)
    m, x, step = _case(name)
    b = budget_at(constant_bytes(m, x), peak_of(step), 0.5)
    m, x, step = _case(name)  # (peak_of ran a step: start again from the same weights)
    mem = dtr.budget(b, plan=INLINE, cost_model="flops")
    for i in range(4):
        with mem:
            step()
        mem._check()
        got = grads_of(m)
        assert all(torch.equal(g, w) for g, w in zip(got, want[i])), (name, i)
    modes = [s["plan"] for s in mem.step_stats]
    if name == "cnn" and not mem.plans:  # (through a dispatch mode its op stream differs, and no plan gains)
        assert all("no gain" in e for e in mem.plan_errors) and set(modes) == {"recorded", "online"}
        return
    # (the first step is its own: the second is recorded again: Note [Planned steps])
    assert modes in (["recorded", "planned", "planned", "planned"], ["recorded", "diverged", "recorded", "planned"]), \
        (modes, mem.plan_errors)
    first, planned = mem.step_stats[0], mem.step_stats[-1]
    assert planned["remat_compute"] == planned["predicted_remat"]  # (flops: the replay's figure, exactly)
    assert planned["remat_compute"] < first["remat_compute"]       # the plan beats online DTR here
    assert planned["planned_evictions"] > 0 and planned["plan_diverged_at"] is None
    assert planned["peak_bytes"] <= b


def test_a_step_that_differs_goes_on_online_and_stays_exact():
    m, x, step, b = _mlp_at_half()
    small, target = x[:200], torch.randint(0, 10, (200,))
    mem = dtr.budget(b, plan=INLINE, cost_model="flops")
    with mem:
        step()
    with mem:  # the last, short batch
        step(small, target)
    got = grads_of(m)
    m2, _, step2 = _case("mlp")
    step2()
    step2(small, target)
    assert all(torch.equal(g, w) for g, w in zip(got, grads_of(m2)))
    s = mem.step_stats[1]
    assert s["plan"] == "diverged" and s["plan_diverged_at"] is not None and s["plan_ops"] == s["plan_diverged_at"]
    assert s["peak_bytes"] <= b


def test_a_step_that_ends_before_its_plan_says_where():
    """A step that stops short of the plan (a forward without backward) diverged where it stopped."""
    m, x, step, b = _mlp_at_half()
    mem = dtr.budget(b, plan=INLINE, cost_model="flops")
    for _ in range(3):
        with mem:
            step()
    with mem, torch.no_grad():
        m(x)
    s = mem.stats
    assert s["plan"] == "diverged" and s["plan_diverged_at"] is not None and s["plan_diverged_at"] <= s["plan_ops"]


def test_a_planned_step_replays_to_its_own_evictions_and_recomputations(tmp_path):
    m, x, step, b = _mlp_at_half()
    mem = dtr.budget(b, plan=INLINE, cost_model="flops", log=tmp_path / "step.jsonl")
    for _ in range(4):
        with mem:
            step()
    s = mem.step_stats[-1]
    assert s["plan"] == "planned"
    plan = mem.plans[s["plan_signature"]]
    log = read_log(tmp_path / "step.jsonl")
    assert step_signature(log_fingerprints(log)) == s["plan_signature"] == plan.signature
    r = replay(log, "eqclass", b, thrash_limit=float("inf"), plan=plan)
    assert (r.status, r.evictions, r.planned_evictions, r.remats, r.remat_compute) == \
        ("ok", s["evictions"], s["planned_evictions"], s["remats"], s["remat_compute"])
    assert r.plan_diverged_at is None


@pytest.mark.slow
def _sum_fingerprints(how: str):
    """The fingerprints of a core step that sums gradients a and b (``how``), then reads the sum."""
    c = Core("eqclass", None)
    c.record_fingerprints(True)
    w = c.constant(64)
    a, b = [c.call([w], [64], [-1], 1.0)[0] for _ in range(2)]
    if how == "into a constant":  # (a write to a pinned storage makes no new version: no outputs)
        c.pin(a)
        op = c.begin_call([a, b], [], [], [], 1.0)
    else:  # autograd's a.add_(b), a new version of a's storage; or a + b, a new storage; or a 32-byte output
        size = 32 if how == "smaller" else 64
        op = c.begin_call([a, b], [size], [-1], [0 if how == "in place" else -1], 1.0)
    c.end_call(op, 1.0)
    outs = c.op_outputs(op)
    c.call([outs[0] if outs else a], [64], [-1], 1.0)
    return c.fingerprints()


def test_a_sum_in_place_or_out_of_place_fingerprints_alike():
    """Autograd sums a gradient in place or not as dtr's own references move its storage's use count (Note
    [Sums in place or not] in csrc/core_follow.cpp): a step that followed the other kind's plan diverged at the
    sum, and a loop whose two kinds of step planned each other never followed a plan to its end."""
    out_of_place = _sum_fingerprints("out of place")
    assert out_of_place == _sum_fingerprints("in place")
    assert out_of_place[2] == _sum_fingerprints("into a constant")[2]  # (its readers then read the old tensor)
    assert _sum_fingerprints("smaller")[2] != out_of_place[2]  # (an output of other bytes still differs)


def test_steps_that_always_differ_are_recorded_once():
    rng = random.Random(0)
    torch.manual_seed(0)
    model = TreeLSTM(16, 32)
    x = torch.randn(12, 4, 16)
    trees = [random_tree(rng, list(range(12))) for _ in range(5)]

    def step(tree):  # a new tree every step
        model.zero_grad(set_to_none=True)
        model(x, [tree]).pow(2).mean().backward()

    peak = max(peak_of(lambda t=t: step(t)) for t in trees)
    mem = dtr.budget(budget_at(constant_bytes(model, x), peak, 0.7), plan=INLINE, cost_model="flops")
    for t in trees:
        with mem:
            step(t)
    modes = [s["plan"] for s in mem.step_stats]
    assert modes.count("recorded") <= 2 and modes[0] == "recorded", modes
    assert all(m in ("online", "diverged") for m in modes[3:]), modes


def test_a_loop_that_alternates_between_two_shapes_gets_a_plan_for_each():
    """Note [Planned steps]: the step after B is expected to be A's (it was last time). Before, the A B loop
    recorded every A step and never planned B (found by a helper's hunt, 2026-11-29)."""
    m, x, step, b = _mlp_at_half()
    y = torch.randint(0, 10, (256,))
    mem = dtr.budget(b, plan=INLINE, cost_model="flops")
    sigs = []
    for i in range(10):
        with mem:
            step(x, y) if i % 2 == 0 else step(x[:200], y[:200])
        sigs.append(mem.stats["plan_signature"])
    modes = [s["plan"] for s in mem.step_stats]
    assert len(set(sigs[2:])) == 2 and set(sigs[2:]) <= set(mem.plans), (modes, mem.plan_errors)
    assert modes.count("recorded") <= 4 and modes[-4:] == ["planned"] * 4, (modes, mem.plan_errors)


@pytest.mark.slow
def test_the_program_exits_cleanly_while_a_thread_plans(tmp_path):
    """A planning thread still running when the program ends: before, the interpreter killed it inside the
    planner's C++ (SIGABRT, "terminate called without an active exception") in 3 of 6 runs of this script."""
    script = tmp_path / "exit_while_planning.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.nn as nn, torch.nn.functional as F, dtr
        from dtr.runtime.step_plans import PlanPolicy
        torch.manual_seed(0)
        m = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Dropout(0.1)) for _ in range(6)],
                          nn.Linear(128, 10))
        x, y = torch.randn(256, 128), torch.randint(0, 10, (256,))

        def step():
            torch.manual_seed(1)
            m.zero_grad(set_to_none=True)
            F.cross_entropy(m(x), y).backward()

        with dtr.budget(None, cost_model="flops") as b:
            step()
        const = sum(t.untyped_storage().nbytes() for t in [*m.parameters(), x, y])
        mem = dtr.budget(int(const + 0.4 * (b.stats["peak_bytes"] - const)), cost_model="flops",
                         plan=PlanPolicy(background="thread"))
        with mem:
            step()
        print("done", flush=True)  # (the planning thread is still running)
    """))
    for _ in range(3):
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                           env=child_env())
        assert r.returncode == 0 and "done" in r.stdout, (r.returncode, r.stderr[-2000:])


def test_planning_in_a_process_of_its_own():
    m, x, step, b = _mlp_at_half()
    mem = dtr.budget(b, plan=6.0, cost_model="flops")  # (the default: a process; a time limit of 6 s)
    for _ in range(4):
        with mem:
            step()
        assert mem.wait_for_plan(120), "the planning process did not finish"
    assert mem.stats["plan"] == "planned", (mem.step_stats, mem.plan_errors)
    mem.close()


def test_plan_arguments_are_checked():
    with pytest.raises(ValueError, match="lookahead"):
        dtr.budget("1MB", plan="nosuch")
    with pytest.raises(ValueError, match="needs a budget"):
        dtr.budget(None, plan=True)
    with pytest.raises(TypeError, match="planner"):
        dtr.budget("1MB", plan=[1])
    with pytest.raises(ValueError, match="time_limit must be a positive number of seconds"):
        dtr.budget("1MB", plan=-1.0)
    for field, bad in [("drift", -1.0), ("drift", float("nan")), ("max_plans", 1.5), ("repeat", 0),
                       ("time_limit", True), ("time_limit", "5")]:
        with pytest.raises(ValueError, match=f"PlanPolicy.{field} must be"):
            dtr.budget("1MB", plan=PlanPolicy(**{field: bad}))
    once = dtr.budget("1GB")
    with once:
        pass
    with pytest.raises(RuntimeError, match="plan="):
        with once:
            pass
    with dtr.budget("1GB"):
        with pytest.raises(NestingError, match="plan"):
            with dtr.budget("1GB", plan=True):
                pass


def test_a_dropped_budget_leaves_no_work_files():
    m, x, step = _case("mlp")
    mem = dtr.budget(budget_at(constant_bytes(m, x), peak_of(step), 0.5), plan=True, cost_model="flops")
    with mem:
        step()
    workdir = mem._plans._dir
    assert os.path.isdir(workdir)
    del mem
    gc.collect()
    assert not os.path.exists(workdir)  # (and the planning process, if still running, was stopped)


@pytest.mark.slow
def test_huggingface_trainer_follows_its_plan_from_the_second_step(tmp_path):
    # Trainer.train() for ten steps, each micro-batch's forward and backward in the same planned budget at
    # half a step's tracked peak: the losses, weights and optimizer state are plain PyTorch's, and every step
    # after the recorded first one follows the plan (the optimizer's step runs outside the block).
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    ref = hf_train(contextlib.nullcontext(), tmp_path, max_steps=10, optim="adamw_torch")
    probes: list = []

    def probe():
        probes.append(dtr.budget(None, cost_model="flops"))
        return probes[-1]

    hf_train(contextlib.nullcontext(), tmp_path, step_ctx=probe, max_steps=1, optim="adamw_torch")
    mem = dtr.budget(probes[0].stats["peak_bytes"] // 2, plan=INLINE, cost_model="flops")
    out = hf_train(contextlib.nullcontext(), tmp_path, step_ctx=lambda: mem, max_steps=10, optim="adamw_torch")
    assert out["losses"] == ref["losses"] and out["sched"] == ref["sched"]
    assert_same_state(out["model"], ref["model"], out["opt"], ref["opt"])
    modes = [s["plan"] for s in mem.step_stats]
    assert modes == ["recorded"] + ["planned"] * 9, (modes, mem.plan_errors)
    first, later = mem.step_stats[0], mem.step_stats[1:]
    assert first["evictions"] > 0 and all(s["planned_evictions"] > 0 for s in later), mem.step_stats
    assert all(s["peak_bytes"] <= mem.budget_bytes for s in mem.step_stats), mem.step_stats
    assert all(s["plan_diverged_at"] is None and s["remat_compute"] == s["predicted_remat"] for s in later)


def test_a_plan_from_the_first_step_is_made_for_the_steps_that_follow():
    # Note [Planning the steps that follow]: the first block counts the weights and gradients from the op that
    # first touches them, later blocks from their first op, so later steps have less room early on. Planned
    # as it stands, the first step's log judged every plan against an online DTR that later steps cannot
    # match, and kept none here (measured); planned as later steps see it, the plan is kept, followed, and
    # recomputes what it predicts, less than online DTR in those steps.
    def case():
        torch.manual_seed(0)
        m = TinyGPT(64, 64, 2, 3, 64)
        x = torch.randint(0, 64, (8, 64))
        m(x).pow(2).mean().backward()  # the gradients exist before the first block: constants in it

        def step():
            torch.manual_seed(1)
            m.zero_grad(set_to_none=False)
            out = m(x).pow(2).mean()
            out.backward()
            return out.detach()
        return m, x, step

    m, x, step = case()
    b = budget_at(constant_bytes(m, x) + sum(p.grad.untyped_storage().nbytes() for p in m.parameters()),
                  peak_of(step), 0.4)
    m, x, step = case()
    for _ in range(3):
        with dtr.budget(b, cost_model="flops") as online:
            step()
    want = grads_of(m)
    m, x, step = case()
    mem = dtr.budget(b, plan=INLINE, cost_model="flops")
    for _ in range(3):
        with mem:
            step()
    assert [s["plan"] for s in mem.step_stats] == ["recorded", "planned", "planned"], mem.plan_errors
    for s in mem.step_stats[1:]:
        assert s["evictions"] == 0 and s["remat_compute"] == s["predicted_remat"] < online.stats["remat_compute"]
    assert all(torch.equal(a, b) for a, b in zip(grads_of(m), want))


def test_measured_steps_charge_the_runtime_s_own_time_per_recomputation():
    m, x, step = _case("cnn")
    b = budget_at(constant_bytes(m, x), peak_of(step), 0.4)  # (a plan recomputes far less here: 19 against 32)
    m, x, step = _case("cnn")
    mem = dtr.budget(b, plan=INLINE, cost_model="time")
    for _ in range(5):
        with mem:
            step()
    stats = mem.step_stats
    assert all(s["cost_unit"] == "ns" and s["remats"] > 0 for s in stats)
    # Each step's time per recomputation beyond its op's; a step sees the median of those before it.
    own = [max(0.0, (s["remat_seconds"] - s["remat_compute"] * 1e-9) / s["remats"]) for s in stats]
    assert [s["remat_overhead_seconds"] for s in stats] == \
        [statistics.median(own[:k]) if k else 0.0 for k in range(len(stats))]
    # A recorded step's plan is made with the estimate that includes it, in the log's ns.
    charges = {round(statistics.median(own[:k + 1]) / 1e-9, 3) for k, s in enumerate(stats) if s["plan"] == "recorded"}
    assert mem.plans, mem.plan_errors
    assert {round(p.remat_overhead, 3) for p in mem.plans.values()} <= charges
    planned = [s for s in stats if s["plan"] == "planned"]
    assert planned, [s["plan"] for s in stats]
    for s in planned:  # the prediction adds the charge per predicted recomputation
        plan = mem.plans[s["plan_signature"]]
        assert 0 < plan.predicted_remats == s["remats"] < plan.online_remats
        assert s["expected_remat_seconds"] == pytest.approx(
            s["predicted_remat_seconds"] * s["op_time_ratio"] + plan.predicted_remats * s["remat_overhead_seconds"])


@pytest.mark.parametrize("diverging", [False, True], ids=["matching", "diverging"])
def test_a_plan_that_runs_out_of_budget_is_dropped_and_made_again(diverging):
    """A step that runs out of budget after following its plan, to the op where it failed or to an op that
    differed (here the program says so mid-step) drops the plan; the steps after it are recorded and planned
    again (Note [Planned steps]): what the plan evicted may be what left the step no room."""
    m, x, step, b = _mlp_at_half()
    mem = dtr.budget(b, plan=INLINE, cost_model="flops")
    for _ in range(2):
        with mem:
            step()
    assert mem.stats["plan"] == "planned", (mem.step_stats, mem.plan_errors)
    sig = mem.stats["plan_signature"]
    with pytest.raises(dtr.OutOfBudgetError):
        with mem:
            torch.manual_seed(1)
            m.zero_grad(set_to_none=True)
            m(x)  # (the step's forward: the plan followed so far)
            if diverging:
                torch.ones(3).exp()  # (an op the recorded step did not have)
            raise dtr.OutOfBudgetError(b, b + 1, "simulated")
    assert sig not in mem.plans and any("ran out of budget" in e for e in mem.plan_errors), mem.plan_errors
    modes = []
    for _ in range(3):
        with mem:
            step()
        modes.append(mem.stats["plan"])
    assert modes == ["recorded", "planned", "planned"], (modes, mem.plan_errors)


def test_closing_while_a_step_is_planned_lets_it_be_planned_later():
    m, x, step, b = _mlp_at_half()
    mem = dtr.budget(b, plan=PlanPolicy(background="thread", time_limit=6), cost_model="flops")
    with mem:
        step()
    mem.close()  # (the first step's planning is dropped)
    modes = []
    for _ in range(4):
        with mem:
            step()
        mem.wait_for_plan(120)
        modes.append(mem.stats["plan"])
    assert "recorded" in modes and modes[-1] == "planned", (modes, mem.plan_errors)


def test_an_optimizer_inside_the_block_does_not_fail_the_steps_after_the_first():
    """Adam inside the block: the first step creates its state, which every later step holds from its first op.
    The first step's plan spent that room; followed by the second step (which diverges at the optimizer, whose
    first step is its own) it left online DTR nothing to evict, and every step after the first ran out of budget
    at a budget online DTR fits each step in (Note [A step that starts with more] in csrc/core_follow.cpp)."""
    def setup():
        torch.manual_seed(0)
        m = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Tanh()) for _ in range(8)])
        return m, torch.optim.Adam(m.parameters(), lr=1e-3), torch.Generator().manual_seed(1)

    def step(m, opt, g):
        x = torch.randn(512, 128, generator=g)
        opt.zero_grad(set_to_none=True)
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss.detach()

    steps = 5
    m, opt, g = setup()
    want = [step(m, opt, g) for _ in range(steps)], [p.detach().clone() for p in m.parameters()]
    m, opt, g = setup()
    peak = 0
    for _ in range(2):
        with dtr.budget(None) as b:
            step(m, opt, g)
        peak = max(peak, b.stats["peak_bytes"])
    limit = int(peak * 0.6)
    m, opt, g = setup()
    for _ in range(steps):  # (online DTR, a fresh block per step, fits every step: the premise)
        with dtr.budget(limit, cost_model="flops"):
            step(m, opt, g)
    m, opt, g = setup()
    mem = dtr.budget(limit, plan=INLINE, cost_model="flops")
    got = []
    for _ in range(steps):
        with mem:
            got.append(step(m, opt, g))
    assert all(torch.equal(a, b) for a, b in zip(got, want[0]))
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), want[1]))
    first, second = mem.step_stats[:2]
    assert second["start_bytes"] > first["start_bytes"] + limit // 16  # (Adam's state)
    assert second["plan"] == "diverged" and second["plan_diverged_at"] == 0 and second["planned_evictions"] == 0
