"""DistributedDataParallel (gloo, 2 processes on this machine) with each rank inside dtr.budget.

Each rank trains STEPS steps of a small MLP on its half of the batch at a budget
that forces evictions; the all-reduced gradients and updated parameters must equal a
single-process plain reference on the same data split (the mean of the two
halves' gradients, computed without DDP and without dtr) within float tolerance
of the all-reduce sum order, and bit for bit a DDP run without dtr. With ``plan``,
each rank reuses one planned budget for every step (``dtr.budget(B, plan=...)``):
it records, plans and follows its own plan, the all-reduce inside its steps.
"""
from __future__ import annotations

import copy
import json
import socket
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from support.paths import child_env  # noqa: E402

WORKER = textwrap.dedent("""
    import copy, json, os, sys
    import torch, torch.distributed as dist, torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    import dtr
    from support.models import mlp
    from support.training import budget_at, constant_bytes

    from dtr.runtime.step_plans import PlanPolicy

    rank, world, mode, out = int(sys.argv[1]), 2, sys.argv[2], sys.argv[3]
    steps, width, depth, FRACTION = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), float(sys.argv[7])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = mlp(width=width, depth=depth, p=0.1)

    def shard_of(k):  # each step's batch is made when it runs: the program holds no later batch
        g = torch.Generator().manual_seed(1000 + k)
        x, y = torch.randn(512, width, generator=g), torch.randint(0, 10, (512,), generator=g)
        return x.chunk(world)[rank], y.chunk(world)[rank]

    ddp = DDP(model, broadcast_buffers=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)

    def step(k, x, y):
        torch.manual_seed(10 + 100 * rank + k)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()   # the all-reduce of the gradient buckets runs here
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        return loss.detach(), grads

    # The budget: a share of one step's activations above constants, grads (and DDP's buckets).
    grads_bytes = sum(p.numel() * 4 for p in model.parameters())
    const = constant_bytes(model, *shard_of(0)) + 2 * grads_bytes
    result = dict(losses=[], grads=[], stats=[])
    planned = None
    for k in range(steps):
        x, y = shard_of(k)
        if mode == "plain":
            loss, grads = step(k, x, y)
        elif mode == "plan" and k == 0:  # a first step with no limit: its peak sets one budget for the rest
            with dtr.budget(None, cost_model="flops") as probe:
                loss, grads = step(k, x, y)
            limit = budget_at(const, probe.stats["peak_bytes"], FRACTION)
            planned = dtr.budget(limit, cost_model="flops", plan=PlanPolicy(background="inline", time_limit=6))
        else:
            if mode == "dtr":
                with dtr.budget(None, cost_model="flops") as probe:  # the plain step's peak, on a copy
                    m2 = copy.deepcopy(model)
                    torch.manual_seed(10 + 100 * rank + k)
                    F.cross_entropy(m2(x), y).backward()
                limit = budget_at(const, probe.stats["peak_bytes"], FRACTION)
            with planned if planned is not None else dtr.budget(limit, cost_model="flops") as b:
                loss, grads = step(k, x, y)
            s = b.stats
            result["stats"].append(dict(limit=limit, peak=s["peak_bytes"], evictions=s["evictions"],
                                        remats=s["remats"], plan=s.get("plan"), remat=s["remat_compute"],
                                        predicted=s.get("predicted_remat")))
        result["losses"].append(loss.item())
        result["grads"].append([g.tolist() for g in grads])
        del grads  # (the next step's constants are the model's, DDP's and its batch's alone)
    result["params"] = [p.detach().tolist() for p in model.parameters()]
    result["plan_errors"] = planned.plan_errors if planned is not None else []
    dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f)
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(tmp_path, mode, steps=2, width=64, depth=3, fraction=0.6, script=WORKER):
    """Run ``script`` (WORKER's arguments) on two ranks; each rank's JSON result."""
    path = tmp_path / "worker.py"
    path.write_text(script)
    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    outs = [tmp_path / f"{mode}-rank{r}.json" for r in range(2)]
    argv = [mode, None, str(steps), str(width), str(depth), str(fraction)]
    procs = [subprocess.Popen([sys.executable, str(path), str(r), *[str(outs[r]) if a is None else a for a in argv]],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    errors = []
    for r, p in enumerate(procs):
        try:
            _, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        if p.returncode != 0:
            errors.append(f"rank {r} exited {p.returncode}:\n{err[-3000:]}")
    assert not errors, "\n".join(errors)
    return [json.loads(o.read_text()) for o in outs]


def reference(steps=2, width=64, depth=3, world=2):
    """One process, no DDP, no dtr: each step's gradient is the mean of the ranks' gradients."""
    import torch.nn.functional as F
    from support.models import mlp
    torch.manual_seed(0)
    model = mlp(width=width, depth=depth, p=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [[] for _ in range(world)], []
    for k in range(steps):
        g = torch.Generator().manual_seed(1000 + k)
        x, y = torch.randn(512, width, generator=g), torch.randint(0, 10, (512,), generator=g)
        per_rank = []
        for rank in range(world):
            m = copy.deepcopy(model)
            torch.manual_seed(10 + 100 * rank + k)
            loss = F.cross_entropy(m(x.chunk(world)[rank]), y.chunk(world)[rank])
            loss.backward()
            losses[rank].append(loss.item())
            per_rank.append([p.grad for p in m.parameters()])
        mean = [sum(gs) / world for gs in zip(*per_rank)]
        for p, g in zip(model.parameters(), mean):
            p.grad = g
        grads.append(mean)
        opt.step()
    return losses, grads, [p.detach() for p in model.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("mode,steps,width,depth,fraction", [("dtr", 2, 64, 3, 0.6), ("plan", 6, 256, 6, 0.6)])
def test_ddp_two_ranks_inside_the_budget(tmp_path, mode, steps, width, depth, fraction):
    with_dtr = run_job(tmp_path, mode, steps, width, depth, fraction)
    plain = run_job(tmp_path, "plain", steps, width, depth)
    ref_losses, ref_grads, ref_params = reference(steps, width, depth)
    for rank in range(2):
        got, base = with_dtr[rank], plain[rank]
        # Bit for bit a DDP run without dtr: losses, all-reduced gradients, parameters.
        assert got["losses"] == base["losses"]
        assert got["grads"] == base["grads"]
        assert got["params"] == base["params"]
        # The same as one process computing both halves (up to the all-reduce's summation order).
        assert got["losses"] == ref_losses[rank]
        for k in range(steps):
            for g, r in zip(got["grads"][k], ref_grads[k]):
                torch.testing.assert_close(torch.tensor(g), r, rtol=1e-5, atol=1e-7)
        for p, r in zip(got["params"], ref_params):
            torch.testing.assert_close(torch.tensor(p), r, rtol=1e-5, atol=1e-7)
        for s in got["stats"]:
            assert s["peak"] <= s["limit"], s
        assert sum(s["evictions"] for s in got["stats"]) > 0, got["stats"]
        if mode == "plan":  # (Note [Planned steps]: DDP's second iteration rebuilds its buckets, and differs)
            modes, n = [s["plan"] for s in got["stats"]], steps - 1
            assert modes in (["recorded"] + ["planned"] * (n - 1), ["recorded", "diverged", "recorded"]
                             + ["planned"] * (n - 3)), (got["stats"], got["plan_errors"])
            assert all(s["remat"] == s["predicted"] for s in got["stats"] if s["plan"] == "planned"), got["stats"]
    # Both ranks hold the same (all-reduced) gradients.
    assert with_dtr[0]["grads"] == with_dtr[1]["grads"]


FSDP_WORKER = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist, torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard
    import dtr
    from support.models import mlp
    from dtr.runtime.step_plans import PlanPolicy

    rank, mode, out, steps, width = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = mlp(width=width, depth=4, p=0.1)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)  # each Linear's parameters unsharded before its use and freed after it
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(k):
        g = torch.Generator().manual_seed(1000 + k)
        x, y = torch.randn(256, width, generator=g), torch.randint(0, 10, (256,), generator=g)
        torch.manual_seed(10 + 100 * rank + k)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x.chunk(2)[rank]), y.chunk(2)[rank])
        loss.backward()  # FSDP2 all-gathers each Linear again here, and reduce-scatters its gradients
        return loss.detach()

    result = dict(losses=[], stats=[])
    mem = None
    for k in range(steps):
        if mode == "plain":
            loss = step(k)
        else:
            if mem is None:  # the first step's peak with no limit sets the budget: half of it above what was there
                with dtr.budget(None, cost_model="flops") as probe:
                    loss = step(k)
                s = probe.stats
                limit = s["memory_bytes"] + (s["peak_bytes"] - s["memory_bytes"]) // 2
                policy = PlanPolicy(background="inline", time_limit=4) if mode == "plan" else None
                mem = dtr.budget(limit, cost_model="flops", plan=policy)
            else:
                b = mem if mode == "plan" else dtr.budget(limit, cost_model="flops")
                with b:
                    loss = step(k)
                s = b.stats
                result["stats"].append(dict(limit=limit, peak=s["peak_bytes"], evictions=s["evictions"],
                                            remats=s["remats"], plan=s.get("plan")))
        opt.step()
        result["losses"].append(loss.item())
    result["params"] = [p.full_tensor().detach().tolist() for p in model.parameters()]
    dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f)
""")


@pytest.mark.slow
def test_fsdp2_two_ranks_inside_the_budget(tmp_path):
    """FSDP2 (fully_shard) frees each unsharded parameter after use and allocates it again before the next
    (Note [Storages the program resizes]): under a budget that evicts, online and planned, every loss and
    parameter equals a run without dtr bit for bit."""
    pytest.importorskip("torch.distributed.fsdp", reason="FSDP2 (fully_shard) is not in this torch")
    if not hasattr(torch.distributed.fsdp, "fully_shard"):
        pytest.skip("FSDP2 (fully_shard) is not in this torch")
    plain = run_job(tmp_path, "plain", 4, 128, 4, 0.0, script=FSDP_WORKER)
    for mode in ("dtr", "plan"):
        got = run_job(tmp_path, mode, 4, 128, 4, 0.0, script=FSDP_WORKER)
        for rank in range(2):
            assert got[rank]["losses"] == plain[rank]["losses"], mode
            assert got[rank]["params"] == plain[rank]["params"], mode
            stats = got[rank]["stats"]
            assert all(s["peak"] <= s["limit"] for s in stats), stats
            assert sum(s["evictions"] for s in stats) > 0 and sum(s["remats"] for s in stats) > 0, stats


def test_what_a_collective_touches_is_pinned_and_never_recomputed(tmp_path):
    """Note [Collectives]: gloo reads and writes an async all-reduce's tensor after the op returned; running it
    again would need the other ranks. One rank (world size 1) in this process, a budget that evicts."""

    from torch.distributed import _functional_collectives as fc

    import dtr
    from dtr.core import Hold
    from dtr.sim.replay import replay
    _storage = torch._C.TensorBase.untyped_storage  # (the public method is an escape in a block: it pins)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        w = torch.randn(256, 256, requires_grad=True)
        x = torch.randn(64, 256)
        log = tmp_path / "step.jsonl"
        want = None
        for limit in (None, 1_500_000):
            with dtr.budget(limit, cost_model="flops", log=log if limit else None) as b:
                h = torch.tanh(x @ w)
                work = dist.all_reduce(h, async_op=True)           # c10d::allreduce_, in place, async
                g = fc.all_reduce(torch.relu(x @ w), "sum", "0")    # _c10d_functional::all_reduce: a new tensor
                acts = [torch.tanh(h @ w) for _ in range(6)]        # room must be made: evictions
                work.wait()
                g = fc.wait_tensor(g)
                core, version = b._core, b._driver.table.version
                for t, why in ((h, Hold.ESCAPED), (g, Hold.CONSTANT)):  # (g: the backend's memory)
                    s = core.storage_of(version[_storage(t)._cdata])
                    assert core.resident(s) and core.pinned(s) and core.pin_reason(s) == why
                loss = sum(a.sum() for a in acts) + (g * h).sum()
                loss.backward()
            got = (loss.detach(), w.grad.clone())
            w.grad = None
            if limit is None:
                want = got
            else:
                assert b.stats["evictions"] > 0, b.stats
                assert all(torch.equal(a, e) for a, e in zip(got, want))
        # The pins are in the log: a replay makes the runtime's decisions.
        r = replay(str(log), "eqclass", b.stats["budget_bytes"], thrash_limit=float("inf"))
        assert (r.evictions, r.remats) == (b.stats["evictions"], b.stats["remats"])
    finally:
        dist.destroy_process_group()


INPLACE_WORKER = textwrap.dedent("""
    import json, sys, torch, dtr
    import torch.distributed as dist
    rank, kind, out, fraction = int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[7])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)

    def step():
        torch.manual_seed(rank)
        x = torch.randn(64, 64)
        h = torch.tanh(x + 1)
        y = h * 2  # computed from h before the collective writes h
        if kind == "all_reduce":
            dist.all_reduce(h)
        elif kind == "broadcast":
            dist.broadcast(h, 0)
        elif rank == 0:
            dist.send(x, 1)
        else:
            dist.recv(h, 0)
        hs = [h]
        for i in range(10):  # room must be made: y is evicted
            hs.append(torch.tanh(hs[-1] * 1.01 + 0.1))
        return y.tolist(), hs[-1].tolist()

    want = step()
    with dtr.budget(None) as b:
        step()
    with dtr.budget(int(b.stats["peak_bytes"] * fraction), cost_model="flops") as b:
        got = step()
    json.dump({"exact": got == want, "evictions": b.stats["evictions"]}, open(out, "w"))
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("kind", ["all_reduce", "broadcast", "recv"])
def test_a_value_computed_before_a_collective_wrote_its_tensor_is_exact(tmp_path, kind):
    """The in-place collectives write their first argument although their schemas do not say so (Note
    [Collectives] in dtr/runtime/reference.py): a value computed from a tensor before dist.all_reduce,
    broadcast or recv wrote it, once evicted, came back computed from the new bytes."""
    for rank in run_job(tmp_path, kind, fraction=0.5, script=INPLACE_WORKER):
        assert rank["evictions"] > 0 and rank["exact"], rank
