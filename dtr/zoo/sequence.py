"""Sequence zoo models in plain torch: a GPT-style transformer, an LSTM and a TreeLSTM.

The LSTM's cell runs as a Python loop over time steps and the TreeLSTM
recurses in Python over random binary trees drawn from a seeded generator, so
their op graphs are dynamic (data-dependent for the TreeLSTM), the case DTR
handles and static planners do not.
"""
from __future__ import annotations

import math
import random
from typing import List, NamedTuple, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from dtr.zoo.registry import ZooModel, param_count, register_model, seeded

__all__ = ["GPT", "CausalSelfAttention", "LSTMLanguageModel", "LSTMCell", "TreeLSTM", "Tree", "TreeShape",
           "gpt", "lstm", "treelstm", "token_batch", "lm_loss", "random_tree"]


def token_batch(vocab_size: int, seq_len: int):
    """A ``batch(batch_size, seed)`` function of random token sequences for next-token prediction.

    Args:
        vocab_size: tokens are drawn from ``range(vocab_size)``.
        seq_len: the length of the inputs (and of the targets, shifted by one).

    Returns:
        ``batch(batch_size, seed) -> (tokens, next_tokens)``, both ``(batch_size, seq_len)`` int64.
    """

    def batch(batch_size: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=g)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    return batch


def lm_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``model(inputs)`` (logits ``(B, T, V)``) against ``targets`` ``(B, T)``."""
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# --- GPT-style transformer -------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention written out (scores, mask, softmax, dropout, weighted sum)."""

    def __init__(self, d_model: int, n_heads: int, max_len: int, dropout: float):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        self.register_buffer("mask", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d // self.n_heads))
        mask: torch.Tensor = self.mask  # type: ignore[assignment]  # (a registered buffer)
        att = att.masked_fill(~mask[:t, :t], float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, d)
        return self.resid_drop(self.proj(y))


class _Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, max_len: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, max_len, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A pre-LayerNorm decoder-only transformer (token and learned position embeddings, GELU MLPs).

    Args:
        vocab_size: tokens.
        d_model: embedding width.
        n_layers: transformer blocks.
        n_heads: attention heads per block.
        max_len: the longest sequence.
        dropout: dropout probability (embeddings, attention weights, residual branches).
    """

    def __init__(self, vocab_size: int = 256, d_model: int = 128, n_layers: int = 4, n_heads: int = 4,
                 max_len: int = 128, dropout: float = 0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*[_Block(d_model, n_heads, max_len, dropout) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        return self.head(self.ln_f(self.blocks(x)))


@register_model("gpt")
def gpt(vocab_size: int = 256, d_model: int = 128, n_layers: int = 4, n_heads: int = 4, seq_len: int = 128,
        dropout: float = 0.1, seed: int = 0) -> ZooModel:
    """A GPT-style language model on random tokens.

    Args:
        vocab_size: tokens (256: bytes).
        d_model: embedding width.
        n_layers: transformer blocks.
        n_heads: attention heads.
        seq_len: sequence length of the batches (also the model's maximum).
        dropout: dropout probability.
        seed: seed of the initial weights.

    Returns:
        The :class:`ZooModel`.
    """
    module = seeded(seed, lambda: GPT(vocab_size, d_model, n_layers, n_heads, seq_len, dropout))
    shapes = dict(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads, seq_len=seq_len,
                  dropout=dropout, params=param_count(module))
    return ZooModel("gpt", module, token_batch(vocab_size, seq_len), lm_loss, shapes)


# --- LSTM language model ---------------------------------------------------------------------------


class LSTMCell(nn.Module):
    """One LSTM cell step: gates from the input and the previous hidden state (Hochreiter and Schmidhuber)."""

    def __init__(self, input_size: int, hidden_size: int):
        super().__init__()
        self.ih = nn.Linear(input_size, 4 * hidden_size)
        self.hh = nn.Linear(hidden_size, 4 * hidden_size, bias=False)

    def forward(self, x: torch.Tensor, state: Tuple[torch.Tensor, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        h, c = state
        i, f, g, o = (self.ih(x) + self.hh(h)).chunk(4, dim=1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return h, c


class LSTMLanguageModel(nn.Module):
    """A stacked LSTM language model whose cells run in a Python loop over time steps.

    Args:
        vocab_size: tokens.
        embed_size: embedding width.
        hidden_size: LSTM state width.
        n_layers: stacked cells.
        dropout: dropout on the embeddings, between layers and before the head.
    """

    def __init__(self, vocab_size: int = 1000, embed_size: int = 128, hidden_size: int = 256, n_layers: int = 2,
                 dropout: float = 0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_size)
        self.cells = nn.ModuleList(LSTMCell(embed_size if i == 0 else hidden_size, hidden_size)
                                   for i in range(n_layers))
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(hidden_size, vocab_size)
        self.hidden_size = hidden_size

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        x = self.drop(self.embed(idx))
        zero = x.new_zeros(b, self.hidden_size)
        states = [(zero, zero) for _ in self.cells]
        outputs: List[torch.Tensor] = []
        for step in range(t):
            inp = x[:, step]
            for layer, cell in enumerate(self.cells):
                if layer > 0:
                    inp = self.drop(inp)
                states[layer] = cell(inp, states[layer])
                inp = states[layer][0]
            outputs.append(inp)
        return self.head(self.drop(torch.stack(outputs, dim=1)))


@register_model("lstm")
def lstm(vocab_size: int = 1000, embed_size: int = 128, hidden_size: int = 256, n_layers: int = 2,
         seq_len: int = 64, dropout: float = 0.1, seed: int = 0) -> ZooModel:
    """A two-layer LSTM language model on random tokens (cells unrolled in Python).

    Args:
        vocab_size: tokens.
        embed_size: embedding width.
        hidden_size: LSTM state width.
        n_layers: stacked cells.
        seq_len: time steps per batch.
        dropout: dropout probability.
        seed: seed of the initial weights.

    Returns:
        The :class:`ZooModel`.
    """
    module = seeded(seed, lambda: LSTMLanguageModel(vocab_size, embed_size, hidden_size, n_layers, dropout))
    shapes = dict(vocab_size=vocab_size, embed_size=embed_size, hidden_size=hidden_size, n_layers=n_layers,
                  seq_len=seq_len, dropout=dropout, params=param_count(module))
    return ZooModel("lstm", module, token_batch(vocab_size, seq_len), lm_loss, shapes)


# --- TreeLSTM (Tai et al. 2015, binary Tree-LSTM) --------------------------------------------------

TreeShape = Union[int, Tuple["TreeShape", "TreeShape"]]
"""A binary tree: a leaf's position in its sentence, or a pair (left, right) of subtrees."""


class Tree(NamedTuple):
    """One sentence: its tokens and a binary tree over their positions."""

    tokens: torch.Tensor   # (n,) int64
    shape: TreeShape


def random_tree(rng: random.Random, first: int, n: int) -> TreeShape:
    """A random binary tree over leaves ``first .. first + n - 1`` (uniform split points).

    Args:
        rng: the seeded generator.
        first: the position of the leftmost leaf.
        n: the number of leaves (>= 1).

    Returns:
        The tree.
    """
    if n == 1:
        return first
    k = rng.randint(1, n - 1)
    return (random_tree(rng, first, k), random_tree(rng, first + k, n - k))


class TreeLSTM(nn.Module):
    """A binary Tree-LSTM classifier: a recursive Python walk of each tree, one class per root.

    Args:
        vocab_size: tokens.
        embed_size: embedding width.
        hidden_size: state width.
        num_classes: outputs of the head.
        dropout: dropout on the embeddings and the root states.
    """

    def __init__(self, vocab_size: int = 1000, embed_size: int = 64, hidden_size: int = 128, num_classes: int = 5,
                 dropout: float = 0.1):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_size)
        self.leaf_iou = nn.Linear(embed_size, 3 * hidden_size)
        self.node_iou = nn.Linear(2 * hidden_size, 3 * hidden_size)
        self.node_f = nn.Linear(2 * hidden_size, 2 * hidden_size)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(hidden_size, num_classes)

    def _node(self, emb: torch.Tensor, shape: TreeShape) -> Tuple[torch.Tensor, torch.Tensor]:
        if isinstance(shape, int):
            i, o, u = self.leaf_iou(emb[shape:shape + 1]).chunk(3, dim=1)
            c = torch.sigmoid(i) * torch.tanh(u)
            return torch.sigmoid(o) * torch.tanh(c), c
        (hl, cl), (hr, cr) = self._node(emb, shape[0]), self._node(emb, shape[1])
        hx = torch.cat([hl, hr], dim=1)
        i, o, u = self.node_iou(hx).chunk(3, dim=1)
        fl, fr = torch.sigmoid(self.node_f(hx)).chunk(2, dim=1)
        c = torch.sigmoid(i) * torch.tanh(u) + fl * cl + fr * cr
        return torch.sigmoid(o) * torch.tanh(c), c

    def forward(self, trees: List[Tree]) -> torch.Tensor:
        roots = [self._node(self.drop(self.embed(t.tokens)), t.shape)[0] for t in trees]
        return self.head(self.drop(torch.cat(roots, dim=0)))


def _tree_batch(vocab_size: int, min_leaves: int, max_leaves: int, num_classes: int):
    def batch(batch_size: int, seed: int) -> Tuple[List[Tree], torch.Tensor]:
        rng = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        trees = []
        for _ in range(batch_size):
            n = rng.randint(min_leaves, max_leaves)
            trees.append(Tree(torch.randint(0, vocab_size, (n,), generator=g), random_tree(rng, 0, n)))
        return trees, torch.randint(0, num_classes, (batch_size,), generator=g)

    return batch


def _tree_loss(model: nn.Module, inputs: List[Tree], targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(inputs), targets)


@register_model("treelstm")
def treelstm(vocab_size: int = 1000, embed_size: int = 64, hidden_size: int = 128, num_classes: int = 5,
             min_leaves: int = 8, max_leaves: int = 32, dropout: float = 0.1, seed: int = 0) -> ZooModel:
    """A binary TreeLSTM sentence classifier on random trees (the batch is a list of :class:`Tree`).

    The batch's trees come from ``random.Random(seed)``: their sizes and
    shapes, and so the op graph of the step, depend on the data.

    Args:
        vocab_size: tokens.
        embed_size: embedding width.
        hidden_size: state width.
        num_classes: classes of the roots.
        min_leaves: the fewest leaves of a tree.
        max_leaves: the most leaves of a tree.
        dropout: dropout probability.
        seed: seed of the initial weights.

    Returns:
        The :class:`ZooModel`.

    Raises:
        ValueError: ``min_leaves`` < 1 or ``max_leaves`` < ``min_leaves``.
    """
    if not 1 <= min_leaves <= max_leaves:
        raise ValueError(f"need 1 <= min_leaves <= max_leaves (got {min_leaves}, {max_leaves})")
    module = seeded(seed, lambda: TreeLSTM(vocab_size, embed_size, hidden_size, num_classes, dropout))
    shapes = dict(vocab_size=vocab_size, embed_size=embed_size, hidden_size=hidden_size, num_classes=num_classes,
                  min_leaves=min_leaves, max_leaves=max_leaves, dropout=dropout, params=param_count(module))
    return ZooModel("treelstm", module, _tree_batch(vocab_size, min_leaves, max_leaves, num_classes), _tree_loss,
                    shapes)
