"""The zoo's registry: model factories registered by name with :func:`register_model`."""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, List, Mapping, Tuple, TypeVar

import torch
from torch import nn

from dtr.registry import Registry

__all__ = ["ZooModel", "register_model", "get_model", "model_names", "model_options", "check_options", "BatchFn",
           "LossFn", "seeded", "param_count"]

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


def model_options(name: str) -> Mapping[str, Any]:
    """The options of zoo model ``name`` and their defaults (its factory's keyword arguments).

    Raises:
        ValueError: ``name`` is not registered (the message lists the valid names).
    """
    params = inspect.signature(_FACTORIES.get(name)).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


# Note [Checking a zoo model's options]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# An option's default says what it is: a whole number (a size, a count: at
# least 1; the seed: at least 0), a number (finite; a dropout probability
# from 0 to 1) or a string. Checking that here, before the factory runs,
# gives an error that names the option and what it takes, where torch would
# fail later with an error about a tensor's shape (or, for a count such as
# n_layers=-1, not at all). What only one model knows (divisibility, a
# depth of the form 6n + 2) its factory checks, raising ValueError.

def check_options(name: str, options: Mapping[str, Any]) -> None:
    """Check ``options`` for zoo model ``name`` (Note [Checking a zoo model's options]).

    Args:
        name: a registered model name.
        options: keyword arguments for its factory.

    Raises:
        ValueError: ``name`` is not registered, an option it does not take (the
            message lists the ones it does), or a value out of range.
        TypeError: a value of the wrong type (the message says which).
    """
    known = model_options(name)
    for key, value in options.items():
        if key not in known:
            shown = ", ".join(k for k in known if k != "seed")  # (the seed has its own argument: --seed)
            raise ValueError(f"bad option for {name}: no option {key!r} (its options: {shown})")
        default = known[key]
        what = f"bad option for {name}: {key}"
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise TypeError(f"{what} must be true or false (got {value!r})")
        elif isinstance(default, int):
            low = 0 if key == "seed" else 1
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{what} must be a whole number >= {low} (got {value!r})")
            if value < low:
                raise ValueError(f"{what} must be a whole number >= {low} (got {value})")
        elif isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise TypeError(f"{what} must be a finite number (got {value!r})")
            if "dropout" in key and not 0 <= value <= 1:
                raise ValueError(f"{what} is a probability: from 0 to 1 (got {value})")
        elif isinstance(default, str) and not isinstance(value, str):
            raise TypeError(f"{what} must be a string (got {value!r})")


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
            names), an option it does not take (the message lists the ones it
            does), or a value out of range (:func:`check_options`, and the
            factory's own checks).
        TypeError: an option's value of the wrong type.
        ImportError: an optional dependency of the model is missing
            (``transformers`` for ``hf-gpt2``).
    """
    check_options(name, options)
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
