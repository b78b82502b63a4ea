"""The runtime on small models of several shapes: exact training steps at 70%, 50% and 35% of the peak.

A GPT-style transformer with dropout (causal attention in plain torch), an LSTM
written as a Python loop over time, a recursive TreeLSTM over data-dependent
(seeded random) binary trees, and the MLP of tests/support/models.py. Sizes are
chosen so that activations dominate. Each run uses heuristic="eqclass" and
cost_model="flops" (one case also `dtr`) and must equal plain PyTorch bit for bit. At 35% an
OutOfBudgetError is accepted only if the budget is below what the output
condition alone requires (constants + gradients + loss resident at the end).
"""
from __future__ import annotations

import copy
import random

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from support.models import LoopLSTM, PaperUNet, TinyGPT, TreeLSTM, mlp, random_tree, tree_depth  # noqa: E402
from support.training import assert_same_grads, budget_at, constant_bytes, peak_of  # noqa: E402
from support.training import seeded_step as step  # noqa: E402

import dtr  # noqa: E402


def gpt():
    model = TinyGPT(vocab=64, d=32, heads=2, layers=2, seq=64, p=0.1)
    ids = torch.randint(0, 64, (16, 64))
    return model, (ids,), lambda m: F.cross_entropy(m(ids).flatten(0, 1), ids.flatten())


def lstm():
    model = LoopLSTM(inp=16, hidden=64)
    x, y = torch.randn(12, 128, 16), torch.randint(0, 10, (128,))
    return model, (x, y), lambda m: F.cross_entropy(m(x), y)


def treelstm():
    model = TreeLSTM(inp=16, hidden=64)
    x, y = torch.randn(8, 128, 16), torch.randint(0, 10, (128,))
    rng = random.Random(0)
    trees = [random_tree(rng, list(range(8))) for _ in range(2)]
    assert trees[0] != trees[1] and tree_depth(trees[0]) >= 3  # data-dependent, not a fixed chain
    return model, (x, y), lambda m: F.cross_entropy(m(x, trees), y)


def mlp_model():
    model = mlp(width=128, depth=4, p=0.1)
    x, y = torch.randn(1024, 128), torch.randint(0, 10, (1024,))
    return model, (x, y), lambda m: F.cross_entropy(m(x), y)


MODELS = {"gpt": gpt, "lstm": lstm, "treelstm": treelstm, "mlp": mlp_model}


def cases():
    for name in sorted(MODELS):
        for f in (0.7, 0.5, 0.35):
            yield pytest.param(name, f, "eqclass", id=f"{name}-{f}")
    yield pytest.param("lstm", 0.35, "dtr", id="lstm-0.35-dtr")
    # simrd's eqclass (no component splitting) runs out of budget at 37-38% and 42%.
    yield pytest.param("lstm", 0.38, "eqclass", id="lstm-0.38")


@pytest.mark.parametrize("name,f,heuristic", list(cases()))
def test_exact_training_step_within_budget(name, f, heuristic):
    torch.manual_seed(0)
    model, inputs, loss_fn = MODELS[name]()
    ref = copy.deepcopy(model)
    ref_loss = step(ref, loss_fn)
    const = constant_bytes(model, *inputs)
    peak = peak_of(lambda: step(copy.deepcopy(model), loss_fn))
    limit = budget_at(const, peak, f)
    # What the output condition alone needs at the end: constants, every gradient, the loss.
    output_condition = const + sum(p.numel() * p.element_size() for p in model.parameters()) + 4
    assert peak - const > 4 * (output_condition - const), "activations must dominate"
    try:
        with dtr.budget(limit, heuristic=heuristic, cost_model="flops") as b:
            loss = step(model, loss_fn)
    except dtr.OutOfBudgetError:
        if f <= 0.35 and limit < output_condition:
            pytest.skip(f"infeasible: {limit} bytes is below the output condition ({output_condition})")
        raise  # the budget covers the output condition: running out is a failure
    assert torch.equal(loss, ref_loss)
    assert_same_grads(model, ref)
    assert b.stats["peak_bytes"] <= limit
    assert b.stats["evictions"] > 0
    if f <= 0.5:
        assert b.stats["remats"] > 0


@pytest.mark.slow
def test_the_paper_s_unet_ends_its_block_within_any_budget_its_step_fitted():
    # Issue 32: the DTR paper's UNet (2x3x96x96 against random labels, the step returning its loss) at
    # 159,353,830 B ran its step but failed at the block's end: bringing back a 9 MiB weight gradient before
    # an 18 MiB one needed 1.7 MB more (the core's Note [The order of a bring-back]). The budgets are the
    # issue's, as fractions of the tracked peak (191,143,336 B there), after a tracked block as a user would
    # measure it, all on one model, and each is exact within its budget. At the last the weights and gradients
    # alone nearly fill the budget (138.5 of 150 MB), and the block still ends. (At 147 MB, with flop costs,
    # it does not: the step fits, but bringing back a gradient then needs 1.5 MB more.)
    torch.manual_seed(0)
    model = PaperUNet()
    ref = copy.deepcopy(model)
    x, y = torch.randn(2, 3, 96, 96), torch.randint(0, 2, (2, 96, 96))

    def loss_fn(m):
        return F.cross_entropy(m(x), y)

    step(ref, loss_fn)
    with dtr.budget(None, cost_model="flops") as tracked:
        step(model, loss_fn)
    peak = tracked.stats["peak_bytes"]
    for f in (159_353_830 / 191_143_336, 175_264_455 / 191_143_336, 150e6 / 191_143_336):
        ref_loss = step(ref, loss_fn)  # (the same BatchNorm running statistics after each step)
        with dtr.budget(int(f * peak), cost_model="flops") as b:
            loss = step(model, loss_fn)
        assert torch.equal(loss, ref_loss)
        assert_same_grads(model, ref)
        assert b.stats["peak_bytes"] <= int(f * peak) and b.stats["remats"] > 0
