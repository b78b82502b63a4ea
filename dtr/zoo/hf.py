"""Hugging Face ``transformers`` GPT-2, built from a local ``GPT2Config`` (random weights, no download).

``transformers`` is optional (the ``zoo`` extra): it is imported when the
model is built, and a missing install is a clear :class:`ImportError`.
"""
from __future__ import annotations

from typing import Any, Tuple

import torch
from torch import nn

from dtr.zoo.registry import ZooModel, param_count, register_model, seeded

__all__ = ["hf_gpt2"]


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ImportError("the zoo model 'hf-gpt2' needs Hugging Face transformers: "
                          "pip install 'dtr[zoo]' (or pip install transformers)") from e
    return transformers


def _batch(vocab_size: int, seq_len: int):
    def batch(batch_size: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=g)
        return ids, ids.clone()  # GPT2LMHeadModel shifts the labels itself

    return batch


def _loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return model(input_ids=inputs, labels=targets, use_cache=False).loss


@register_model("hf-gpt2")
def hf_gpt2(vocab_size: int = 1000, n_embd: int = 128, n_layer: int = 4, n_head: int = 4, seq_len: int = 128,
            dropout: float = 0.1, attn_implementation: str = "eager", seed: int = 0) -> ZooModel:
    """``transformers.GPT2LMHeadModel`` from a small local config, randomly initialised.

    Args:
        vocab_size: tokens.
        n_embd: embedding width.
        n_layer: transformer blocks.
        n_head: attention heads.
        seq_len: sequence length of the batches (also ``n_positions``).
        dropout: ``resid_pdrop``, ``embd_pdrop`` and ``attn_pdrop``.
        attn_implementation: ``"eager"`` (attention written out in torch ops)
            or ``"sdpa"``.
        seed: seed of the initial weights.

    Returns:
        The :class:`ZooModel`; the loss is the model's own shifted LM loss.

    Raises:
        ImportError: ``transformers`` is not installed.
        ValueError: ``attn_implementation`` is neither ``"eager"`` nor ``"sdpa"``.
    """
    if attn_implementation not in ("eager", "sdpa"):
        raise ValueError(f"attn_implementation must be 'eager' or 'sdpa' (got {attn_implementation!r})")
    transformers = _transformers()
    config = transformers.GPT2Config(vocab_size=vocab_size, n_positions=seq_len, n_embd=n_embd, n_layer=n_layer,
                                     n_head=n_head, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                     bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1, use_cache=False)
    config._attn_implementation = attn_implementation

    def build() -> nn.Module:
        m = transformers.GPT2LMHeadModel(config)
        m.loss_type = "ForCausalLM"  # the class name maps to no loss; this is GPT-2's shifted LM loss
        m.train()
        return m

    module = seeded(seed, build)
    shapes = dict(vocab_size=vocab_size, n_embd=n_embd, n_layer=n_layer, n_head=n_head, seq_len=seq_len,
                  dropout=dropout, attn_implementation=attn_implementation,
                  transformers=transformers.__version__, params=param_count(module))
    return ZooModel("hf-gpt2", module, _batch(vocab_size, seq_len), _loss, shapes)
