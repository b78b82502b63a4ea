"""The benchmarks' models: a GPT-style transformer, a ResNet-ish CNN and a TreeLSTM, in plain torch.

bench_runtime.py times them under dtr.budget; the other benchmarks (planned steps, the plan floor, the
checkpointing gap, dispatch floors, CUDA tracking) build the same models from here. Also the RSS
measurement they share: C (the bytes that exist before a step) and P (a plain step's peak over them).
"""
from __future__ import annotations

import math
import os
import random
import sys

# Sizes: (full, smoke)
SIZES = {
    "gpt": ({"layers": 6, "d": 256, "heads": 8, "seq": 256, "batch": 8, "vocab": 512, "p": 0.1},
            {"layers": 2, "d": 128, "heads": 4, "seq": 64, "batch": 8, "vocab": 256, "p": 0.1}),
    "cnn": ({"width": 32, "blocks": [2, 2, 2], "hw": 32, "batch": 16, "classes": 10, "p": 0.1},
            {"width": 16, "blocks": [1, 1], "hw": 32, "batch": 8, "classes": 10, "p": 0.1}),
    "treelstm": ({"hidden": 192, "batch": 128, "leaves": 32, "vocab": 512, "classes": 5},
                 {"hidden": 128, "batch": 128, "leaves": 12, "vocab": 128, "classes": 5}),
}


def build(name: str, cfg: dict):
    """Returns (model, inputs tuple, loss_fn(model, *inputs) -> loss, blocks-forward for checkpointing)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    if name == "gpt":
        class Block(nn.Module):
            def __init__(self, d, h, p):
                super().__init__()
                self.h = h
                self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
                self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
                self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
                self.attn_drop, self.resid_drop, self.mlp_drop = nn.Dropout(p), nn.Dropout(p), nn.Dropout(p)

            def forward(self, x):
                B, T, D = x.shape
                q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
                q = q.view(B, T, self.h, D // self.h).transpose(1, 2)
                k = k.view(B, T, self.h, D // self.h).transpose(1, 2)
                v = v.view(B, T, self.h, D // self.h).transpose(1, 2)
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D // self.h))
                mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
                att = att.masked_fill(~mask, float("-inf"))
                att = self.attn_drop(F.softmax(att, dim=-1))
                y = (att @ v).transpose(1, 2).contiguous().view(B, T, D)
                x = x + self.resid_drop(self.proj(y))
                x = x + self.mlp_drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))
                return x

        class GPT(nn.Module):
            def __init__(self, c):
                super().__init__()
                self.tok = nn.Embedding(c["vocab"], c["d"])
                self.pos = nn.Embedding(c["seq"], c["d"])
                self.drop = nn.Dropout(c["p"])
                self.blocks = nn.ModuleList([Block(c["d"], c["heads"], c["p"]) for _ in range(c["layers"])])
                self.ln = nn.LayerNorm(c["d"])
                self.head = nn.Linear(c["d"], c["vocab"], bias=False)

            def forward(self, idx, checkpoint=False):
                T = idx.shape[1]
                x = self.drop(self.tok(idx) + self.pos(torch.arange(T, device=idx.device)))
                for b in self.blocks:
                    if checkpoint:
                        x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)
                    else:
                        x = b(x)
                return self.head(self.ln(x))

        model = GPT(cfg)
        g = torch.Generator().manual_seed(1)
        idx = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
        tgt = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)

        def loss_fn(m, idx, tgt, checkpoint=False):
            logits = m(idx, checkpoint=checkpoint)
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), tgt.view(-1))
        return model, (idx, tgt), loss_fn

    if name == "cnn":
        class Block(nn.Module):
            def __init__(self, cin, cout, stride, p):
                super().__init__()
                self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
                self.bn1 = nn.BatchNorm2d(cout)
                self.relu = nn.ReLU(inplace=True)
                self.drop = nn.Dropout(p)
                self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
                self.bn2 = nn.BatchNorm2d(cout)
                self.short = None
                if stride != 1 or cin != cout:
                    self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

            def forward(self, x):
                out = self.drop(self.relu(self.bn1(self.conv1(x))))
                out = self.bn2(self.conv2(out))
                out += x if self.short is None else self.short(x)
                return self.relu(out)

        w = cfg["width"]
        layers = [nn.Conv2d(3, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU(inplace=True)]
        cin = w
        for i, n in enumerate(cfg["blocks"]):
            cout = w * 2 ** i
            for j in range(n):
                layers.append(Block(cin, cout, 2 if (j == 0 and i > 0) else 1, cfg["p"]))
                cin = cout
        model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, cfg["classes"]))
        g = torch.Generator().manual_seed(1)
        x = torch.randn(cfg["batch"], 3, cfg["hw"], cfg["hw"], generator=g)
        y = torch.randint(0, cfg["classes"], (cfg["batch"],), generator=g)

        def loss_fn(m, x, y, checkpoint=False):
            return F.cross_entropy(m(x), y)
        return model, (x, y), loss_fn

    if name == "treelstm":
        H = cfg["hidden"]

        class TreeLSTM(nn.Module):
            """Binary (N-ary, N=2) TreeLSTM, recursive over a tree given as nested tuples of leaf ids."""

            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(cfg["vocab"], H)
                self.leaf = nn.Linear(H, 3 * H)      # i, o, u for leaves
                self.node = nn.Linear(2 * H, 5 * H)  # i, o, u, f_l, f_r for internal nodes
                self.out = nn.Linear(H, cfg["classes"])

            def rec(self, tree, tokens):
                if isinstance(tree, int):  # leaf: a column of token ids (batch of sentences sharing a parse)
                    i, o, u = self.leaf(self.emb(tokens[:, tree])).chunk(3, dim=1)
                    c = torch.sigmoid(i) * torch.tanh(u)
                    return torch.sigmoid(o) * torch.tanh(c), c
                (hl, cl), (hr, cr) = self.rec(tree[0], tokens), self.rec(tree[1], tokens)
                i, o, u, fl, fr = self.node(torch.cat([hl, hr], dim=1)).chunk(5, dim=1)
                c = torch.sigmoid(i) * torch.tanh(u) + torch.sigmoid(fl) * cl + torch.sigmoid(fr) * cr
                return torch.sigmoid(o) * torch.tanh(c), c

            def forward(self, tree, tokens):
                h, _ = self.rec(tree, tokens)
                return self.out(h)

        model = TreeLSTM()
        rng = random.Random(1)
        tree = random_tree(0, cfg["leaves"], rng)
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["leaves"]), generator=g)
        y = torch.randint(0, cfg["classes"], (cfg["batch"],), generator=g)

        def loss_fn(m, tokens, y, checkpoint=False):
            return F.cross_entropy(m(tree, tokens), y)
        return model, (tokens, y), loss_fn
    raise ValueError(name)


def training_setup(name: str, cfg: dict):
    """build() in training mode, gradients allocated (zeroed in place each step: part of C).

    Returns:
        (model, inputs, loss_fn, C in bytes: parameters, buffers, inputs and gradients).
    """
    import torch
    model, inputs, loss_fn = build(name, cfg)
    model.train()
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    const = sum(t.untyped_storage().nbytes() for t in [*params, *model.buffers(), *inputs])
    const += sum(p.grad.untyped_storage().nbytes() for p in params)
    return model, inputs, loss_fn, const


def plain_peak(step) -> int:
    """P: what a plain ``step()`` adds to the process's RSS high-water mark (Linux), after one warm-up step."""
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # see Note [Allocator settings]
        print("warning: MALLOC_MMAP_THRESHOLD_ is not set: glibc reuses freed memory, so the RSS high-water "
              "mark understates the step's peak (run with MALLOC_MMAP_THRESHOLD_=65536)", file=sys.stderr)
    step()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = rss_status()["rss"]
    step()
    return rss_status()["hwm"] - base


def random_tree(lo: int, hi: int, rng: random.Random):
    """A random binary bracketing of leaves lo..hi-1, as nested pairs (the TreeLSTM's data-dependent shape)."""
    if hi - lo == 1:
        return lo
    k = rng.randint(lo + 1, hi - 1)
    return (random_tree(lo, k, rng), random_tree(k, hi, rng))


def rss_status() -> dict:
    """This process's RSS and its high-water mark (VmHWM) in bytes, from /proc/self/status (Linux)."""
    d = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, v = line.split(":", 1)
            d[k] = v.strip()
    return {"hwm": int(d["VmHWM"].split()[0]) * 1024, "rss": int(d["VmRSS"].split()[0]) * 1024}
