"""The zoo's registry: model factories registered by name with :func:`register_model`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Mapping, Tuple, TypeVar

import torch
from torch import nn

from dtr.registry import Registry

__all__ = ["ZooModel", "register_model", "get_model", "model_names", "BatchFn", "LossFn", "seeded", "param_count"]

BatchFn = Callable[[int, int], Tuple[Any, Any]]
"""``batch(batch_size, seed) -> (inputs, targets)``: a deterministic synthetic batch."""

LossFn = Callable[[nn.Module, Any, Any], torch.Tensor]
"""``loss(model, inputs, targets) -> Tensor``: the scalar training loss of one step."""


@dataclass(frozen=True)
class ZooModel:
    """A model ready for a training step, with its data and loss.

    Attributes:
        name: the registered name (``resnet32``, ``gpt``, ...).
        module: the ``nn.Module`` (randomly initialised, in training mode).
        batch: ``batch(batch_size, seed) -> (inputs, targets)``; the same
            arguments always give the same tensors.
        loss: ``loss(model, inputs, targets) -> Tensor``, a scalar.
        shapes: JSON-ready facts about the model's shape (depth, widths,
            input size, ...) for the logs' manifest.
    """

    name: str
    module: nn.Module
    batch: BatchFn
    loss: LossFn
    shapes: Mapping[str, Any] = field(default_factory=dict)


_FACTORIES: Registry[Callable[..., ZooModel]] = Registry("model", sort_names=True)


def register_model(name: str) -> Callable[[Callable[..., ZooModel]], Callable[..., ZooModel]]:
    """Decorator: register a factory ``f(**options) -> ZooModel`` as ``name``.

    Args:
        name: the model's name in :func:`get_model` and ``dtr-sim record``.

    Returns:
        The decorator; it returns the factory unchanged.

    Raises:
        ValueError: ``name`` is already registered.
    """

    def wrap(factory: Callable[..., ZooModel]) -> Callable[..., ZooModel]:
        return _FACTORIES.add(name, factory, replace=False)

    return wrap


def model_names() -> List[str]:
    """The registered model names, sorted."""
    return _FACTORIES.names()


def get_model(name: str, **options: Any) -> ZooModel:
    """Build the zoo model ``name``.

    Args:
        name: a registered name (see :func:`model_names`).
        **options: keyword arguments of the model's factory (sizes such as
            ``width``, ``depth``, ``image_size``, ``seq_len``; ``seed`` for the
            initial weights).

    Returns:
        A :class:`ZooModel` in training mode.

    Raises:
        ValueError: ``name`` is not registered (the message lists the valid
            names).
        TypeError: an option the factory does not take.
        ImportError: an optional dependency of the model is missing
            (``transformers`` for ``hf-gpt2``).
    """
    return _FACTORIES.get(name)(**options)


T = TypeVar("T")


def seeded(seed: int, build: Callable[[], T]) -> T:
    """Call ``build()`` with the global CPU generator seeded, restoring the caller's RNG state after.

    Args:
        seed: the seed (module initialisers draw from the global generator).
        build: what to call, typically a module constructor.

    Returns:
        What ``build()`` returns.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


def param_count(module: nn.Module) -> int:
    """The number of parameters of ``module`` (shared parameters counted once)."""
    return sum(p.numel() for p in module.parameters())
