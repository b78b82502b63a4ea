"""Demo: one training step of an MLP with dropout, plain and under dtr budgets.

Prints the step's peak (dtr's accounting), evictions and recomputations at each
budget, and checks that the loss and every gradient are bit-for-bit those of
plain PyTorch.
"""
import copy

import torch
import torch.nn.functional as F
from torch import nn

import dtr


def main() -> None:
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [nn.Linear(256, 256), nn.ReLU(), nn.Dropout(0.1)]
    model = nn.Sequential(*layers, nn.Linear(256, 10))
    x, y = torch.randn(2048, 256), torch.randint(0, 10, (2048,))

    def step(m):
        torch.manual_seed(1)
        m.zero_grad(set_to_none=True)
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        return loss.detach()

    ref = copy.deepcopy(model)
    ref_loss = step(ref)
    with dtr.budget(None) as b:
        step(copy.deepcopy(model))
    peak = b.stats["peak_bytes"]
    const = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), x, y])
    print(f"plain step: peak {peak / 2**20:.1f} MiB (weights and inputs {const / 2**20:.1f} MiB)")
    for f in (0.7, 0.5, 0.35):
        limit = int(const + f * (peak - const))
        m = copy.deepcopy(model)
        with dtr.budget(limit) as b:
            loss = step(m)
        same = torch.equal(loss, ref_loss) and all(torch.equal(p.grad, q.grad)
                                                    for p, q in zip(m.parameters(), ref.parameters()))
        s = b.stats
        print(f"budget {limit / 2**20:6.1f} MiB ({f:.0%} of the step's own memory): "
              f"peak {s['peak_bytes'] / 2**20:6.1f} MiB, "
              f"{s['evictions']} evictions, {s['remats']} recomputations, gradients identical: {same}")


if __name__ == "__main__":
    main()
