"""A model zoo for recording logs (see ``dtr-sim record``).

Each model is registered by name with :func:`register_model`; :func:`get_model`
builds one as a :class:`ZooModel` (the module, a seeded synthetic batch, the
loss and shape facts). Models: ``resnet32``, ``densenet-bc``, ``unet``
(:mod:`dtr.zoo.vision`), ``gpt``, ``lstm``, ``treelstm``
(:mod:`dtr.zoo.sequence`) and ``hf-gpt2`` (:mod:`dtr.zoo.hf`, needs
``transformers``, imported only when the model is built).

Importing this package imports torch.
"""
from __future__ import annotations

from dtr.zoo import hf, sequence, vision  # noqa: F401  (registers the models)
from dtr.zoo.registry import BatchFn, LossFn, ZooModel, get_model, model_names, register_model

__all__ = ["ZooModel", "BatchFn", "LossFn", "register_model", "get_model", "model_names"]
