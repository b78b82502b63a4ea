"""DistributedDataParallel (gloo, 2 processes on this machine) with each rank inside dtr.budget.

Each rank trains 2 steps of a small MLP on its half of the batch at a budget that
forces evictions; the all-reduced gradients and updated parameters must equal a
single-process plain reference on the same data split (the mean of the two
halves' gradients, computed without DDP and without dtr) within float tolerance
of the all-reduce sum order, and bit for bit a DDP run without dtr.
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

    rank, world, use_dtr, out = int(sys.argv[1]), 2, sys.argv[2] == "dtr", sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = mlp(width=64, depth=3, p=0.1)
    data = [(torch.randn(512, 64), torch.randint(0, 10, (512,))) for _ in range(2)]
    shard = [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in data]
    ddp = DDP(model, broadcast_buffers=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)

    def step(k):
        x, y = shard[k]
        torch.manual_seed(10 + 100 * rank + k)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()   # the all-reduce of the gradient buckets runs here
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        return loss.detach(), grads

    # The budget: half of one step's activations above constants, grads (and DDP's buckets).
    grads_bytes = sum(p.numel() * 4 for p in model.parameters())
    const = constant_bytes(model, *[t for xy in shard for t in xy]) + 2 * grads_bytes
    result = dict(losses=[], grads=[], stats=[])
    for k in range(2):
        if use_dtr:
            with dtr.budget(None, cost_model="flops") as probe:  # the plain step's peak, on a copy
                m2 = copy.deepcopy(model)
                torch.manual_seed(10 + 100 * rank + k)
                F.cross_entropy(m2(shard[k][0]), shard[k][1]).backward()
            limit = budget_at(const, probe.stats["peak_bytes"], 0.5)
            with dtr.budget(limit, cost_model="flops") as b:
                loss, grads = step(k)
            s = b.stats
            result["stats"].append(dict(limit=limit, peak=s["peak_bytes"], evictions=s["evictions"],
                                        remats=s["remats"]))
        else:
            loss, grads = step(k)
        result["losses"].append(loss.item())
        result["grads"].append([g.tolist() for g in grads])
    result["params"] = [p.detach().tolist() for p in model.parameters()]
    dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f)
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(tmp_path, mode):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    outs = [tmp_path / f"{mode}-rank{r}.json" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, str(script), str(r), mode, str(outs[r])], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
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


def reference(steps=2, world=2):
    """One process, no DDP, no dtr: each step's gradient is the mean of the ranks' gradients."""
    import torch.nn.functional as F
    from support.models import mlp
    torch.manual_seed(0)
    model = mlp(width=64, depth=3, p=0.1)
    data = [(torch.randn(512, 64), torch.randint(0, 10, (512,))) for _ in range(2)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [[] for _ in range(world)], []
    for k in range(steps):
        x, y = data[k]
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
def test_ddp_two_ranks_inside_the_budget(tmp_path):
    with_dtr = run_job(tmp_path, "dtr")
    plain = run_job(tmp_path, "plain")
    ref_losses, ref_grads, ref_params = reference()
    for rank in range(2):
        got, base = with_dtr[rank], plain[rank]
        # Bit for bit a DDP run without dtr: losses, all-reduced gradients, parameters.
        assert got["losses"] == base["losses"]
        assert got["grads"] == base["grads"]
        assert got["params"] == base["params"]
        # The same as one process computing both halves (up to the all-reduce's summation order).
        assert got["losses"] == ref_losses[rank]
        for k in range(2):
            for g, r in zip(got["grads"][k], ref_grads[k]):
                torch.testing.assert_close(torch.tensor(g), r, rtol=1e-5, atol=1e-7)
        for p, r in zip(got["params"], ref_params):
            torch.testing.assert_close(torch.tensor(p), r, rtol=1e-5, atol=1e-7)
        for s in got["stats"]:
            assert s["peak"] <= s["limit"], s
        assert sum(s["evictions"] for s in got["stats"]) > 0, got["stats"]
    # Both ranks hold the same (all-reduced) gradients.
    assert with_dtr[0]["grads"] == with_dtr[1]["grads"]
