"""Small models for the runtime tests: activations dominate their memory (big batch or sequence, few parameters)."""
from __future__ import annotations

import math
import random
from typing import List, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn


def mlp(width: int = 256, depth: int = 6, p: float = 0.1) -> nn.Module:
    """``depth`` Linear-ReLU-Dropout(p) layers of ``width`` features, then a 10-way Linear head."""
    layers: List[nn.Module] = []
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



class RandomOpsNet(nn.Module):
    """A forward that calls the RNG explicitly: ``torch.rand_like`` noise and ``F.dropout``."""

    def __init__(self, width: int = 128, depth: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for lin in self.layers:
            h = lin(x)
            noise = torch.rand_like(h)           # a random mask kept for the backward of the mul
            x = F.dropout(torch.relu(h) * (0.5 + noise), p=0.2, training=True)
        return self.head(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int, p: float):
        super().__init__()
        self.heads, self.p = heads, p
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).split(D, dim=2)
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D // self.heads))
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        att = F.dropout(att, self.p, self.training)
        y = (att @ v).transpose(1, 2).reshape(B, T, D)
        return F.dropout(self.proj(y), self.p, self.training)


class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int, p: float):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads, p)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.p = p

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + F.dropout(self.out(F.gelu(self.fc(self.ln2(x)))), self.p, self.training)


class TinyGPT(nn.Module):
    """A GPT-style decoder with dropout; causal attention written in plain torch."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 2, layers: int = 2, seq: int = 64,
                 p: float = 0.1):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(GPTBlock(d, heads, p) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.p = p

    def forward(self, ids):
        T = ids.shape[1]
        x = F.dropout(self.tok(ids) + self.pos(torch.arange(T, device=ids.device)), self.p, self.training)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


class LoopLSTM(nn.Module):
    """An LSTM written as a Python loop over time steps (gates by hand)."""

    def __init__(self, inp: int = 16, hidden: int = 64, classes: int = 10):
        super().__init__()
        self.hidden = hidden
        self.wx = nn.Linear(inp, 4 * hidden)
        self.wh = nn.Linear(hidden, 4 * hidden, bias=False)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):  # x: (T, B, inp)
        B = x.shape[1]
        h = x.new_zeros(B, self.hidden)
        c = x.new_zeros(B, self.hidden)
        for t in range(x.shape[0]):
            i, f, g, o = (self.wx(x[t]) + self.wh(h)).chunk(4, dim=1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
        return self.head(h)


Tree = Union[int, Tuple["Tree", "Tree"]]  # a leaf: the index of its input row; a node: (left, right)


def random_tree(rng: random.Random, leaves: List[int]) -> Tree:
    """A random binary tree over ``leaves`` (its shape depends on the seed of ``rng``)."""
    if len(leaves) == 1:
        return leaves[0]
    cut = rng.randint(1, len(leaves) - 1)
    return (random_tree(rng, leaves[:cut]), random_tree(rng, leaves[cut:]))


def tree_depth(tree: Tree) -> int:
    return 0 if isinstance(tree, int) else 1 + max(tree_depth(tree[0]), tree_depth(tree[1]))


class TreeLSTM(nn.Module):
    """A binary (N-ary, N=2) TreeLSTM evaluated recursively over a data-dependent tree.

    A batch of B examples shares one tree shape; each leaf reads a (B, inp) slice.
    """

    def __init__(self, inp: int = 16, hidden: int = 64, classes: int = 10):
        super().__init__()
        self.hidden = hidden
        self.leaf = nn.Linear(inp, 3 * hidden)
        self.node = nn.Linear(2 * hidden, 5 * hidden)
        self.head = nn.Linear(hidden, classes)

    def encode(self, x, tree: Tree):
        if isinstance(tree, int):
            i, o, u = self.leaf(x[tree]).chunk(3, dim=1)
            c = torch.sigmoid(i) * torch.tanh(u)
            return torch.sigmoid(o) * torch.tanh(c), c
        (hl, cl), (hr, cr) = self.encode(x, tree[0]), self.encode(x, tree[1])
        i, fl, fr, o, u = self.node(torch.cat([hl, hr], dim=1)).chunk(5, dim=1)
        c = torch.sigmoid(i) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
        return torch.sigmoid(o) * torch.tanh(c), c

    def forward(self, x, trees: Sequence[Tree]):  # x: (leaves, B, inp)
        return sum(self.head(self.encode(x, t)[0]) for t in trees)


class _DoubleConv(nn.Sequential):
    def __init__(self, cin: int, cout: int, mid: int = 0):
        mid = mid or cout
        super().__init__(nn.Conv2d(cin, mid, 3, padding=1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(inplace=True),
                         nn.Conv2d(mid, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class PaperUNet(nn.Module):
    """The U-Net of the DTR paper's artifact (bilinear upsampling, widths 64 to 512; 17M parameters).

    As the widely used PyTorch U-Net it follows: double 3x3 convolutions with BatchNorm, four max-pool
    downsamplings, bilinear upsamplings concatenated with the skips.
    """

    def __init__(self, channels: int = 3, classes: int = 2):
        super().__init__()
        self.inc = _DoubleConv(channels, 64)
        self.down = nn.ModuleList(_DoubleConv(a, b) for a, b in ((64, 128), (128, 256), (256, 512), (512, 512)))
        self.up = nn.ModuleList(_DoubleConv(a, b, a // 2) for a, b in ((1024, 256), (512, 128), (256, 64), (128, 64)))
        self.out = nn.Conv2d(64, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = [self.inc(x)]
        for down in self.down:
            skips.append(down(F.max_pool2d(skips[-1], 2)))
        x = skips.pop()
        for up in self.up:
            x = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=True)
            x = up(torch.cat([skips.pop(), x], 1))
        return self.out(x)
