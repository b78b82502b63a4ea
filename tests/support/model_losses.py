"""Five small models with a loss over fixed inputs, shared by the native path's differential tests."""
from __future__ import annotations

import random
from typing import Callable, Dict, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from support.models import LoopLSTM, TinyGPT, TreeLSTM, cnn, mlp, random_tree
from support.training import train_step


def model_losses() -> Dict[str, Callable[[], Tuple[nn.Module, Callable[[], torch.Tensor]]]]:
    """Builders of five small models, each returning the model and a loss closure over fixed inputs."""
    def gpt():
        m = TinyGPT(vocab=64, d=32, heads=2, layers=2, seq=32, p=0.1)
        ids = torch.randint(0, 64, (8, 32))
        return m, lambda: F.cross_entropy(m(ids).flatten(0, 1), ids.flatten())

    def lstm():
        m = LoopLSTM(inp=16, hidden=32)
        x, y = torch.randn(8, 64, 16), torch.randint(0, 10, (64,))
        return m, lambda: F.cross_entropy(m(x), y)

    def treelstm():
        m = TreeLSTM(inp=16, hidden=32)
        x, y = torch.randn(8, 64, 16), torch.randint(0, 10, (64,))
        trees = [random_tree(random.Random(0), list(range(8))) for _ in range(2)]
        return m, lambda: F.cross_entropy(m(x, trees), y)

    def mlp_model():
        m = mlp(width=64, depth=4, p=0.1)
        x, y = torch.randn(256, 64), torch.randint(0, 10, (256,))
        return m, lambda: train_step(m, x, y)

    def cnn_model():
        m = cnn()
        x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
        return m, lambda: train_step(m, x, y)
    return {"gpt": gpt, "lstm": lstm, "treelstm": treelstm, "mlp": mlp_model, "cnn": cnn_model}
