"""Small models for the runtime tests (activations dominate their memory)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def mlp(width: int = 256, depth: int = 6, p: float = 0.1) -> nn.Module:
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU(), nn.Dropout(p)]
    return nn.Sequential(*layers, nn.Linear(width, 10))


class Block(nn.Module):
    """Conv-BN-ReLU(inplace)-Dropout-Conv-BN, residual +=, ReLU(inplace)."""

    def __init__(self, c: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.1)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        out = self.drop(self.relu(self.bn1(self.conv1(x))))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


def cnn(c: int = 16, blocks: int = 3) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, c, 3, padding=1), *[Block(c) for _ in range(blocks)],
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))


def constant_bytes(model: nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes of the tensors that exist before the step: parameters, buffers, inputs."""
    ts = list(model.parameters()) + list(model.buffers()) + list(inputs)
    return sum(t.untyped_storage().nbytes() for t in ts)


def train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """One seeded training step (cross-entropy); returns the detached loss."""
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach()
