"""Whole training loops inside ONE ``dtr.budget`` block, bit for bit against plain PyTorch.

Each test runs a loop of several optimizer steps (Hugging Face ``Trainer.train()``;
plain loops with gradient clipping, LR schedulers, fused/foreach AdamW, SGD with
momentum, gradient accumulation, bf16 autocast, dropout, batch norm) once without
dtr and then inside one block at fractions of the block's own peak with no limit
(cost_model="flops", so decisions are deterministic). After the loop the losses of
every step, all parameters, buffers, optimizer state tensors and the scheduler's
state must be equal (torch.equal), the peak within the budget, and at least one
budget per test must have evicted and recomputed. A fraction that raises
OutOfBudgetError or ThrashingError is allowed, but not all of them.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable, Dict, List

import pytest

torch = pytest.importorskip("torch")
from support.hf import hf_train  # noqa: E402
from support.training import assert_same_state  # noqa: E402
from torch import nn  # noqa: E402

import dtr  # noqa: E402

FRACTIONS = (0.7, 0.5)


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: on a loaded 2-core machine OpenMP spinning makes these loops 10x slower.

    Both runs of a comparison use the same setting, so exactness is unaffected.
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# --------------------------------------------------------------------- helpers


def run_at_fractions(run: Callable[[contextlib.AbstractContextManager], Dict], check: Callable[[Dict, str], None]):
    """Measure the tracking peak of ``run``, then run it at FRACTIONS of it; returns the stats per fraction.

    ``run(ctx)`` runs the whole loop inside ``ctx`` and returns what ``check`` compares with the reference.
    """
    b = dtr.budget(None, cost_model="flops")
    out = run(b)
    check(out, "tracking: ")
    out = None  # what an earlier block left held counts as constants in the next one: hold nothing
    peak = b.stats["peak_bytes"]
    assert peak > 0
    done = {}
    for f in FRACTIONS:
        limit = int(f * peak)
        b = dtr.budget(limit, cost_model="flops")
        try:
            out = run(b)
        except (dtr.OutOfBudgetError, dtr.ThrashingError):
            continue
        check(out, f"at {f} of the peak: ")
        assert b.stats["peak_bytes"] <= limit, (f, b.stats["peak_bytes"], limit)
        done[f] = dict(b.stats)
        out = None
    assert any(s["evictions"] > 0 and s["remats"] > 0 for s in done.values()), \
        f"no budget in {FRACTIONS} of {peak} bytes ran and recomputed: {done}"
    return done


# ------------------------------------------------------- Hugging Face Trainer


@pytest.mark.parametrize("extra", [
    {},                                                      # default optimizer: fused AdamW on recent torch
    {"optim": "adamw_torch"},                                # foreach AdamW
    {"optim": "adamw_torch", "gradient_accumulation_steps": 2},
], ids=["default-optim", "adamw_torch", "adamw_torch-accum2"])
def test_huggingface_trainer_train_in_one_block(extra, tmp_path):
    """Trainer.train() (3 steps, grad clipping, linear LR schedule) under one budget: same losses and state."""
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    logging.getLogger("accelerate").setLevel(logging.ERROR)

    ref = hf_train(contextlib.nullcontext(), tmp_path, **extra)
    n_micro = 3 * extra.get("gradient_accumulation_steps", 1)
    assert len(ref["losses"]) == n_micro and ref["global_step"] == 3
    if not extra:
        assert ref["opt"].defaults.get("fused"), "expected the default optimizer to be fused AdamW"

    def check(out, what):
        assert out["losses"] == ref["losses"], what
        assert out["train_loss"] == ref["train_loss"], what
        assert out["global_step"] == ref["global_step"], what
        assert out["sched"] == ref["sched"], what
        assert_same_state(out["model"], ref["model"], out["opt"], ref["opt"], what)

    run_at_fractions(lambda ctx: hf_train(ctx, tmp_path, **extra), check)


# ---------------------------------------------------------------- plain loops


def mlp_with_dropout() -> nn.Module:
    layers: List[nn.Module] = []
    for i in range(4):
        layers += [nn.Linear(16 if i == 0 else 128, 128), nn.GELU(), nn.Dropout(0.2)]
    return nn.Sequential(*layers, nn.Linear(128, 10))


def convnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Dropout2d(0.1),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Dropout(0.2), nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(0.3), nn.Linear(16 * 8 * 8, 10))


MODELS = {
    "mlp": (mlp_with_dropout, lambda g: torch.randn(512, 16, generator=g)),  # narrow inputs, wide activations
    "cnn": (convnet, lambda g: torch.randn(16, 3, 16, 16, generator=g)),
}

OPTIMIZERS = {
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "sgd-momentum-foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, foreach=True),
}

SCHEDULERS = {
    "onecycle": lambda opt, steps: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=steps),
    "steplr": lambda opt, steps: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
}

STEPS = 4

# (model, optimizer, scheduler, micro-batches per step, bf16 autocast, zero_grad(set_to_none=...))
LOOPS = [
    ("mlp", "adamw-fused", "onecycle", 1, False, True),
    ("mlp", "adamw-foreach", "steplr", 2, True, False),
    ("mlp", "sgd-momentum-foreach", "onecycle", 2, False, False),
    ("cnn", "adamw-fused", "steplr", 2, True, True),
    ("cnn", "sgd-momentum-foreach", "onecycle", 1, False, True),
]


def plain_train(ctx, model_name, opt_name, sched_name, micro, autocast, set_to_none) -> Dict:
    """STEPS optimizer steps, each over ``micro`` micro-batches, with clip_grad_norm_ and a scheduler, in ``ctx``."""
    make_model, make_x = MODELS[model_name]
    torch.manual_seed(0)
    model = make_model()
    g = torch.Generator().manual_seed(1)  # the data: drawn batch by batch inside the loop, like a loader
    opt = OPTIMIZERS[opt_name](model.parameters())
    sched = SCHEDULERS[sched_name](opt, STEPS)
    losses: List[float] = []
    norms: List[float] = []
    torch.manual_seed(2)  # the dropout masks
    with ctx:
        model.train()
        for _ in range(STEPS):
            opt.zero_grad(set_to_none=set_to_none)
            for _ in range(micro):
                x = make_x(g)
                y = torch.randint(0, 10, (x.shape[0],), generator=g)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    out = model(x)
                loss = nn.functional.cross_entropy(out.float(), y) / micro
                loss.backward()
                losses.append(loss.item())
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)))
            opt.step()
            sched.step()
    return dict(model=model, opt=opt, sched=sched.state_dict(), losses=losses, norms=norms)


def _loop_id(c) -> str:
    model, opt, sched, micro, autocast, set_to_none = c
    return (f"{model}-{opt}-{sched}-accum{micro}-{'bf16' if autocast else 'fp32'}-"
            f"{'set_to_none' if set_to_none else 'zeroed'}")


@pytest.mark.parametrize("loop", LOOPS, ids=[_loop_id(c) for c in LOOPS])
def test_plain_training_loop_in_one_block(loop):
    """A plain loop (clipping, scheduler, accumulation, autocast, dropout) under one budget: same losses and state."""
    ref = plain_train(contextlib.nullcontext(), *loop)
    assert len(ref["losses"]) == STEPS * loop[3]
    assert len(set(ref["losses"])) == len(ref["losses"])  # the steps really differ

    def check(out, what):
        assert out["losses"] == ref["losses"], what
        assert out["norms"] == ref["norms"], what
        assert out["sched"] == ref["sched"], what
        assert_same_state(out["model"], ref["model"], out["opt"], ref["opt"], what)

    run_at_fractions(lambda ctx: plain_train(ctx, *loop), check)


def test_the_comparison_sees_a_different_dropout_mask():
    """Guard on the check itself: a loop whose dropout draws differ fails assert_same_state."""
    ref = plain_train(contextlib.nullcontext(), *LOOPS[0])

    @contextlib.contextmanager
    def reseeded():
        torch.manual_seed(3)  # other masks, same everything else
        yield

    other = plain_train(reseeded(), *LOOPS[0])
    assert other["losses"][0] != ref["losses"][0]
    with pytest.raises(AssertionError):
        assert_same_state(other["model"], ref["model"], other["opt"], ref["opt"])
