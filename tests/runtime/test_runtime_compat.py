"""The runtime with the rest of PyTorch: grad modes, autocast, accumulation, retained graphs,
Hugging Face models, torch.compile, many steps, escaped memory, RNG.

Every test compares against plain PyTorch bit for bit (seeding torch before both
runs so that dropout draws the same masks), checks ``peak_bytes <= budget``
where a budget is set, and that evictions (and recomputations) happened where
the budget is tight. Budgets are "at f of the plain step's peak": constants
(parameters, buffers, inputs) + f x (dtr's peak with no limit - constants).
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode  # noqa: E402

import dtr  # noqa: E402

# Storage introspection that does not count as the program's memory escaping (dtr/runtime/escapes.py).
_storage = torch._C.TensorBase.untyped_storage
from support.models import RandomOpsNet, mlp  # noqa: E402
from support.training import assert_same_grads, budget_at, constant_bytes, peak_of, train_step  # noqa: E402

from dtr.core import ReplayStatus  # noqa: E402
from dtr.runtime import prediction  # noqa: E402
from dtr.sim import replay  # noqa: E402


def assert_tight(b, limit):
    s = b.stats
    assert s["peak_bytes"] <= limit, (s["peak_bytes"], limit)
    assert s["evictions"] > 0 and s["remats"] > 0, s


# ----------------------------------------------------------- grad modes


def held_forward(model, x):
    """A forward that keeps every hidden activation and sums them at the end (they must come back)."""
    hs, h = [], x
    for layer in model:
        h = layer(h)
        hs.append(h)
    return sum(t.sum(dim=1) for t in hs[:-1]) + hs[-1].sum(dim=1)


@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
def test_forward_without_autograd_at_a_tight_budget(grad_mode):
    ctx = getattr(torch, grad_mode)
    torch.manual_seed(0)
    model, x = mlp(width=128, depth=6, p=0.0), torch.randn(512, 128)
    with ctx():
        ref = held_forward(model, x)
        const = constant_bytes(model, x)
        limit = budget_at(const, peak_of(lambda: held_forward(model, x)), 0.5)
        with dtr.budget(limit, cost_model="flops") as b:
            out = held_forward(model, x)
    assert torch.equal(out, ref)
    assert_tight(b, limit)
    assert _get_current_dispatch_mode() is None


# ------------------------------------------------------------- autocast


def autocast_step(model, x, y):
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach()


def test_autocast_bf16_forward_and_backward():
    torch.manual_seed(0)
    model, x, y = mlp(width=128, depth=4, p=0.1), torch.randn(512, 128), torch.randint(0, 10, (512,))
    ref = copy.deepcopy(model)
    ref_loss = autocast_step(ref, x, y)
    peak = peak_of(lambda: autocast_step(copy.deepcopy(model), x, y))
    limit = budget_at(constant_bytes(model, x, y), peak, 0.5)
    with dtr.budget(limit, cost_model="flops") as b:
        loss = autocast_step(model, x, y)
    assert loss.dtype == ref_loss.dtype and torch.equal(loss, ref_loss)
    assert_same_grads(model, ref)
    assert_tight(b, limit)


# ------------------------------------------------ accumulation, retain_graph


def accumulate(model, xs, ys):
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    losses = []
    for x, y in zip(xs, ys):
        loss = F.cross_entropy(model(x), y) / len(xs)
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses)


def test_gradient_accumulation_over_three_micro_batches():
    torch.manual_seed(0)
    model = mlp(width=64, depth=3, p=0.1)
    xs, ys = torch.randn(3, 256, 64).unbind(0), torch.randint(0, 10, (3, 256)).unbind(0)
    ref = copy.deepcopy(model)
    ref_losses = accumulate(ref, xs, ys)
    peak = peak_of(lambda: accumulate(copy.deepcopy(model), xs, ys))
    limit = budget_at(constant_bytes(model, *xs, *ys), peak, 0.5)
    with dtr.budget(limit, cost_model="flops") as b:
        losses = accumulate(model, xs, ys)
    assert torch.equal(losses, ref_losses)
    assert_same_grads(model, ref)
    assert_tight(b, limit)


def two_backwards(model, x, y):
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    loss.backward()
    return loss.detach(), first


def test_retain_graph_with_two_backward_calls():
    torch.manual_seed(0)
    model, x, y = mlp(width=64, depth=4, p=0.1), torch.randn(512, 64), torch.randint(0, 10, (512,))
    ref = copy.deepcopy(model)
    ref_loss, ref_first = two_backwards(ref, x, y)
    peak = peak_of(lambda: two_backwards(copy.deepcopy(model), x, y))
    limit = budget_at(constant_bytes(model, x, y), peak, 0.5)
    with dtr.budget(limit, cost_model="flops") as b:
        loss, first = two_backwards(model, x, y)
    assert torch.equal(loss, ref_loss)
    for g, r in zip(first, ref_first):
        assert torch.equal(g, r)
    assert_same_grads(model, ref)  # the second backward doubled them
    assert_tight(b, limit)


# -------------------------------------------------------- Hugging Face


def test_huggingface_gpt2_training_step_at_half_the_peak():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=64, vocab_size=128,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.train()
    ids = torch.randint(0, 128, (8, 64))

    def step(m):
        torch.manual_seed(1)
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    ref = copy.deepcopy(model)
    ref_loss = step(ref)
    peak = peak_of(lambda: step(copy.deepcopy(model)))
    limit = budget_at(constant_bytes(model, ids), peak, 0.5)
    with dtr.budget(limit, cost_model="flops") as b:
        loss = step(model)
    assert torch.equal(loss, ref_loss)
    assert_same_grads(model, ref)
    assert_tight(b, limit)


# ------------------------------------------------------------ torch.compile


@pytest.mark.slow  # (torch.compile: over 30 s with a cold compile cache, as in CI)
def test_compiled_function_inside_the_budget():
    """Compiled code inside the block runs and gives plain PyTorch's results.

    The block ignores torch.compile (Note [Compiled code in a block]): the
    function's ops run eagerly and dtr sees them, so the result is bit-for-bit
    the eager one.
    """
    torch.manual_seed(0)
    model, x, y = mlp(width=64, depth=3, p=0.0), torch.randn(256, 64), torch.randint(0, 10, (256,))

    def step(m):
        m.zero_grad(set_to_none=True)
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        return loss.detach()

    compiled = torch.compile(step)
    compiled_loss = compiled(copy.deepcopy(model))  # compiled (and warmed up) outside the block
    eager = copy.deepcopy(model)
    eager_loss = step(eager)
    # 70%: a 3-layer MLP's backward needs about 51% of its activation peak at once (the compiled one more).
    limit = budget_at(constant_bytes(model, x, y), peak_of(lambda: step(copy.deepcopy(model))), 0.7)
    with dtr.budget(limit, cost_model="flops") as b:
        loss = compiled(model)
    torch.testing.assert_close(loss, compiled_loss)
    assert torch.equal(loss, eager_loss)
    assert_same_grads(model, eager)
    assert b.stats["peak_bytes"] <= limit
    # A function compiled for the first time inside the block also runs.
    fn = torch.compile(lambda a, w: torch.relu(a @ w).sum(dim=1), backend="aot_eager")
    w = torch.randn(64, 64)
    with dtr.budget(None, cost_model="flops"):
        got = fn(x, w)
    assert torch.equal(got, torch.relu(x @ w).sum(dim=1))
    assert _get_current_dispatch_mode() is None


def test_a_nested_block_runs_on_the_outer_one():
    """(tests/runtime/test_nesting.py has the rest.)"""
    x = torch.randn(16, 16)
    with dtr.budget(None) as outer:
        y = x * 2
        with dtr.budget("1MB") as inner:
            w = y * 3
        z = y + 1
    assert outer.stats["ops"] == 3 and inner.stats["ops"] == 1 and torch.equal(z, x * 2 + 1)
    assert torch.equal(w, x * 6)
    assert _get_current_dispatch_mode() is None


def test_a_fullgraph_function_runs_eagerly_in_the_block_and_compiled_after_it():
    """``fullgraph=True`` used to raise inside a block ("found no compiled frames").

    See Note [Compiled code in a block].

    The block ignores torch.compile (the "force_eager" stance: nothing is
    compiled in it) and gives the program's stance back at its end: the
    function compiles again after the block.
    """
    from torch._dynamo.testing import CompileCounter
    counter = CompileCounter()
    fn = torch.compile(lambda a: torch.relu(a @ a.T).sum(dim=0), backend=counter, fullgraph=True)
    a = torch.randn(32, 16, requires_grad=True)
    ref = fn(a)
    assert counter.frame_count == 1
    b = torch.randn(48, 16, requires_grad=True)  # a new shape: a recompilation, if anything compiled
    with dtr.budget(None, cost_model="flops") as blk:
        got = fn(b)
        got.sum().backward()
    assert counter.frame_count == 1 and blk.stats["ops"] > 0  # run by dtr, not compiled
    assert torch.equal(got, torch.relu(b @ b.T).sum(dim=0))
    assert torch.equal(fn(a), ref)
    fn(torch.randn(64, 16))
    assert counter.frame_count == 2  # compiled after the block: the stance came back


@pytest.mark.slow  # (torch.compile with inductor: a cold compile cache in CI)
def test_compiled_kernels_never_read_an_evicted_input():
    """Compiled code under dtr runs its ops eagerly, through dtr, so an evicted input comes back first.

    Stepping aside (``ignore_compile_internals``) would let inductor's fused
    kernel read an input dtr had evicted by raw pointer: this very program
    crashed with a segmentation fault that way (docs/design.md,
    "torch.compile").
    """
    from dtr.runtime.entry import ModeEntry
    assert not ModeEntry.ignore_compile_internals()
    torch.manual_seed(0)
    x = torch.randn(256, 128)
    pointwise = torch.compile(lambda h: torch.relu(h) * 1.5 + 0.1)

    def run():
        hs, h = [], x
        for _ in range(8):
            h = torch.tanh(h) + 1.0
            hs.append(h)
        return [pointwise(t).sum() for t in hs]  # the first ones were evicted to make room for the last

    ref = run()
    with dtr.budget(x.numel() * 4 + 4 * x.numel() * 4, cost_model="flops") as b:
        got = run()
    assert b.stats["evictions"] > 0 and b.stats["remats"] > 0
    assert all(torch.equal(a, c) for a, c in zip(got, ref))


# -------------------------------------------------------------- many steps

STEPS = 50


def make_training(seed=0):
    torch.manual_seed(seed)
    model = mlp(width=64, depth=3, p=0.1)
    data = [(torch.randn(256, 64), torch.randint(0, 10, (256,))) for _ in range(4)]
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), data


def train_one(model, opt, data, step):
    x, y = data[step % len(data)]
    loss = train_step(model, x, y, seed=100 + step)
    opt.step()
    return loss


def step_limit(model, data):
    """Half of one step's activations, on top of constants, grads and momentum buffers.

    The constants counted are the parameters and one batch (see block_limit).
    """
    const = constant_bytes(model, *[t for xy in data for t in xy])
    m = copy.deepcopy(model)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    train_one(m, opt, data, 0)  # grads and momentum exist from now on
    grads = sum(p.numel() * 4 for p in model.parameters())
    return budget_at(const + 2 * grads, peak_of(lambda: train_one(m, opt, data, 1)), 0.5)


def block_limit(model, data):
    """step_limit plus the batches a training loop holds besides the current one.

    One block around all steps tracks every batch it has seen as a constant; so
    does one block per step, which counts from its start what earlier blocks
    touched and the program still holds (Note [Constants from earlier blocks]).
    """
    return step_limit(model, data) + constant_bytes(None, *[t for xy in data[1:] for t in xy])


@pytest.mark.parametrize("one_with", [True, False], ids=["one-with-around-all", "one-with-per-step"])
def test_fifty_steps_exact_and_bounded_memory(one_with):
    model, opt, data = make_training()
    limit = block_limit(model, data)
    losses, params, memory, budgets = [], [], [], []

    def record(loss):
        losses.append(loss.item())  # inside the block this brings the loss back if it was evicted
        with _disable_current_modes():  # parameters are constants: always resident; copies untracked
            params.append([p.detach().clone() for p in model.parameters()])

    # (record() turns Python modes off with torch's _disable_current_modes: the mode's entry, pinned)
    if one_with:
        with dtr.budget(limit, cost_model="flops", entry="mode") as b:
            for step in range(STEPS):
                loss = train_one(model, opt, data, step)
                record(loss)
                b._driver.poll()     # liveness as of the end of the step
                b._driver.collect()  # and the graph GC: storages nothing can need again are freed
                memory.append(b.stats["memory_bytes"])
        budgets.append(b)
    else:
        for step in range(STEPS):
            with dtr.budget(limit, cost_model="flops", entry="mode") as b:
                loss = train_one(model, opt, data, step)
                record(loss)
            memory.append(b.stats["memory_bytes"])
            budgets.append(b)

    ref, ref_opt, _ = make_training()
    for step in range(STEPS):
        ref_loss = train_one(ref, ref_opt, data, step)
        assert losses[step] == ref_loss.item(), step
        for p, q in zip(params[step], ref.parameters()):
            assert torch.equal(p, q), step
    for b in budgets:
        assert b.stats["peak_bytes"] <= limit
    assert sum(b.stats["evictions"] for b in budgets) > 0
    slack = 64 * 1024
    assert memory[STEPS - 1] <= memory[4] + slack, (memory[4], memory[STEPS - 1])


def test_one_block_over_steps_replays_to_the_same_decisions(tmp_path):
    """The graph GC frees what nothing can need again, so the log records it: a replay decides the same."""
    model, opt, data = make_training()
    limit = block_limit(model, data)
    path = tmp_path / "steps.jsonl"
    with dtr.budget(limit, cost_model="flops", log=path) as b:
        for step in range(12):
            train_one(model, opt, data, step)
    assert '"collect"' in path.read_text()  # the GC ran (12 steps are over 1,200 ops)
    r = replay(path, "eqclass", limit, thrash_limit=float("inf"))
    assert r.status == ReplayStatus.OK
    assert (r.evictions, r.remats, r.peak_bytes) == (b.stats["evictions"], b.stats["remats"], b.stats["peak_bytes"])
    assert r.evictions > 0


def table_sizes(mode):
    return dict(recipes=len(mode.recomputer.recipes), phys=len(mode.table.phys), alive=len(mode.table.alive),
                storages=mode.core.num_storages, tensors=mode.core.num_tensors, ops=mode.core.num_ops)


def test_fifty_steps_in_one_with_keep_metadata_bounded():
    """Recipes, buffers, live tensors and the core's tables must not grow with the steps of one block.

    Measured twice: right after a graph GC at the end of step 5 and step 50
    (what dtr retains: 45 more steps may add next to nothing; a leak of one
    entry per step adds 45), and as the run leaves them at each step's end
    (the GC runs every few hundred ops, so there they swing with its phase:
    the largest of the last ten steps must stay below twice that of the first ten).
    """
    model, opt, data = make_training()
    limit = block_limit(model, data)
    retained, lagging = {}, []
    with dtr.budget(limit, cost_model="flops") as b:
        for step in range(STEPS):
            train_one(model, opt, data, step)
            mode = b._driver
            mode.poll()
            lagging.append(table_sizes(mode))
            if step + 1 in (5, STEPS):
                mode.collect()
                retained[step + 1] = table_sizes(mode)
    early, late = retained[5], retained[STEPS]
    for k in early:
        assert late[k] <= early[k] + 5, (k, retained)
    for k in early:
        first, last = max(x[k] for x in lagging[:10]), max(x[k] for x in lagging[-10:])
        assert last < 2 * first, (k, first, last)


# ------------------------------------------------------------ escaped memory

ESCAPE_SCRIPT = textwrap.dedent("""
    import sys, numpy as np, torch
    import dtr
    torch.manual_seed(0)
    x = torch.randn(512, 256)
    w = torch.randn(256, 256)
    n = x.numel() * 4
    const = sum(t.untyped_storage().nbytes() for t in (x, w))
    with torch.no_grad():
        with dtr.budget(const + 6 * n, cost_model="flops") as b:
            h = torch.tanh(x)                # cheap to recompute: the heuristic's first choice
            arr = h.numpy() if sys.argv[1] == "numpy" else np.asarray(h)
            ref = arr.copy()
            # Heavy pressure: expensive products, all held (far more than the budget).
            keep = [x @ (w * (i + 1)) for i in range(16)]
            inside = bool((arr == ref).all())
            evictions = b.stats["evictions"]
            del keep
            more = [torch.sin(x + i) for i in range(16)]
            del more
    after = bool((arr == ref).all())
    # (h against its own value when made, not a second tanh(x): on this CPU the process's first tanh can
    # differ from later ones in the last bits, without dtr)
    print(inside, after, evictions, bool(torch.equal(h, torch.from_numpy(ref))), flush=True)
""")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["numpy", "asarray"])
def test_escaped_memory_is_never_evicted(tmp_path, how):
    """A NumPy array over a tensor's memory must keep seeing the tensor's values.

    Run in a subprocess: reading an evicted (freed) buffer through NumPy may crash.
    """
    script = tmp_path / "escape.py"
    script.write_text(ESCAPE_SCRIPT)
    p = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536"))
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    inside, after, evictions, tensor_ok = p.stdout.split()
    assert int(evictions) > 0  # the budget did put the block under pressure
    assert tensor_ok == "True"
    assert inside == "True", "the NumPy array saw freed memory inside the block"
    assert after == "True", "the NumPy array saw stale memory after the block"


NUMPY_BACKED = {
    "from_numpy of an activation": lambda x: torch.from_numpy(x.exp().detach().numpy()),
    "from_numpy of a new array": lambda x: torch.from_numpy(np.full((64, 64), 0.5, dtype=np.float32)),
    "an activation seen by NumPy": lambda x: torch.tensor(x.exp().detach().numpy()) + x.exp(),
}


@pytest.mark.parametrize("make", sorted(NUMPY_BACKED))
@pytest.mark.parametrize("limit", [None, 16 * 64 * 64 * 4], ids=["no-limit", "budget"])
def test_dropped_numpy_shared_storages_are_freed_without_resizing(make, limit):
    """Storages that cannot be resized (NumPy's memory, or memory handed to NumPy) are released, not resized.

    The program drops them inside the block; freeing one used to raise
    "Trying to resize storage that is not resizable" (Note [Storages that
    cannot be resized] in dtr/runtime/mode.py).
    """
    x = torch.randn(64, 64)

    def program():
        y = NUMPY_BACKED[make](x) * 1.5
        z = y + 1
        del y
        return [z * float(k) for k in range(4)]

    want = program()
    with dtr.budget(limit, cost_model="flops") as b:
        got = program()
        b._driver.poll()  # (as the next full poll would) the dropped storage is freed now
    assert all(torch.equal(g, w) for g, w in zip(got, want))


# ------------------------------------------------------- leaving the block


def test_mode_is_gone_after_the_block_and_tensors_are_usable():
    torch.manual_seed(0)
    model, x, y = mlp(width=128, depth=4, p=0.0), torch.randn(512, 128), torch.randint(0, 10, (512,))
    with torch.no_grad():
        ref = [model[:k](x) for k in (2, 4, 6, 8)]
    def body(m):
        with torch.no_grad():
            hidden = [m[:k](x) for k in (2, 4, 6, 8)]
        train_step(m, x, y)  # pressure: the held tensors get evicted
        return hidden

    # 70%: the four held tensors must all be resident at the end (the output condition).
    limit = budget_at(constant_bytes(model, x, y), peak_of(lambda: body(copy.deepcopy(model))), 0.7)
    with dtr.budget(limit, cost_model="flops", entry="mode") as b:  # (a TorchDispatchMode: the mode's entry)
        assert _get_current_dispatch_mode() is not None
        hidden = body(model)
    assert b.stats["evictions"] > 0
    assert _get_current_dispatch_mode() is None
    for h, r in zip(hidden, ref):
        assert _storage(h).nbytes() == h.numel() * 4
        assert torch.equal(h, r)
        assert torch.equal(h * 2 + 1, r * 2 + 1)  # usable in new computations, outside dtr
    # Leaving by an exception also removes the mode.
    with pytest.raises(ZeroDivisionError):
        with dtr.budget(None):
            torch.ones(3).sum()
            raise ZeroDivisionError("the program's own error")
    assert _get_current_dispatch_mode() is None


# ------------------------------------------------------------------- RNG


@pytest.mark.parametrize("f", [0.5, 0.35])
def test_explicit_random_ops_replay_identically(f):
    torch.manual_seed(0)
    model, x, y = RandomOpsNet(width=128, depth=4), torch.randn(512, 128), torch.randint(0, 10, (512,))
    ref = copy.deepcopy(model)
    ref_loss = train_step(ref, x, y)
    limit = budget_at(constant_bytes(model, x, y), peak_of(lambda: train_step(copy.deepcopy(model), x, y)), f)
    with dtr.budget(limit, cost_model="flops") as b:
        loss = train_step(model, x, y)
    assert torch.equal(loss, ref_loss)
    assert_same_grads(model, ref)
    assert_tight(b, limit)
    # The generator ends where plain PyTorch leaves it (replays restore the state they borrowed).
    torch.manual_seed(1)
    train_step(copy.deepcopy(ref), x, y)
    after_plain = torch.rand(4)
    torch.manual_seed(1)
    with dtr.budget(limit, cost_model="flops"):
        train_step(copy.deepcopy(ref), x, y)
    assert torch.equal(torch.rand(4), after_plain)


@pytest.mark.parametrize("native", [True, False], ids=["native", "reference"])
def test_a_size_the_meta_kernel_mispredicts_is_said_once(native, caplog):
    # BatchNorm in eval mode returns empty saved statistics where its meta kernel gives one float per channel
    # (Note [Sizes that differ from the prediction] in prediction.py): exact, and logged once, not every call.
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8)).eval()
    x = torch.randn(4, 3, 16, 16)
    caplog.set_level("WARNING", logger="dtr.runtime")
    prediction._SIZE_WARNINGS.clear()
    for _ in range(3):
        with dtr.budget(None, cost_model="flops", native=native), torch.no_grad():
            y = m(x)
        assert torch.equal(y, m(x))
    said = [r for r in caplog.records if "were predicted" in r.getMessage()]
    assert len(said) == 1 and "native_batch_norm" in said[0].getMessage(), [r.getMessage() for r in said]
