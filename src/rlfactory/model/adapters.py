"""PEFT's per-layer adapter switches, flipped without walking the model on every use.

PEFT's own context managers (``PeftModel.disable_adapter``, ``peft.helpers.disable_input_dtype_casting``) walk
all of a model's modules on entry and on exit -- about 8,000 for a 0.5B model with LoRA on every linear layer --
and ``disable_adapter`` also builds a status report of every layer and flips ``requires_grad`` on every adapter
weight. The training loops enter such a switch up to three times per micro-batch (the reference's forward, the
policy's forward and its backward). In a traced dpo LoRA step (0.5B shape, 4 micro-batches, one H200) the GPU
waited about 60 ms per micro-batch while the host walked the model (42 ms of it the reference's switch), about a
fifth of the step. Here the adapter layers are
found once per model and the switches set only their flags; what a layer does with a flag stays PEFT's code.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def adapter_layers(model: Any) -> list[Any]:
    """PEFT's adapter layers (``BaseTunerLayer``) and trained-module wrappers (``modules_to_save``) of ``model`` or
    of any wrapper of it (DDP), found on the first call for that model object and remembered."""
    layers = _LAYERS.get(model)
    if layers is None:
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import AuxiliaryTrainingWrapper

        layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer | AuxiliaryTrainingWrapper)]
        _LAYERS[model] = layers
    return layers


@contextlib.contextmanager
def adapters_off(model: Any) -> Iterator[Any]:
    """Run ``model`` as its base model: every adapter layer passes its input to the layer it wraps, as under PEFT's
    ``disable_adapter()``. Adapter weights keep ``requires_grad``: use it under ``torch.no_grad()``. Nests, and
    restores each layer's own state on exit."""
    peft_model = [model] if hasattr(model, "_adapters_disabled") else []  # PeftModel's own record of the switch
    with _set(adapter_layers(model), "_disable_adapters", True), _set(peft_model, "_adapters_disabled", True):
        yield model


@contextlib.contextmanager
def input_casting_off(model: Any) -> Iterator[Any]:
    """Adapters take their input in the dtype it comes in (PEFT's ``disable_input_dtype_casting``): under autocast
    the adapter's matmul casts it anyway, and PEFT's own float32 copy would be kept for the backward."""
    layers = [layer for layer in adapter_layers(model) if hasattr(layer, "cast_input_dtype_enabled")]
    with _set(layers, "cast_input_dtype_enabled", False):
        yield model


@contextlib.contextmanager
def _set(objects: list[Any], attribute: str, value: Any) -> Iterator[None]:
    """``attribute`` = ``value`` on every object inside the block; each object's own value back after it."""
    before = [getattr(obj, attribute) for obj in objects]
    for obj in objects:
        setattr(obj, attribute, value)
    try:
        yield
    finally:
        for obj, old in zip(objects, before, strict=True):
            setattr(obj, attribute, old)
