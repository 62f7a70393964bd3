"""What a forward-only program returns: the model's output flattened to tensors, and its structure.

A captured program returns tensors only (``gm(...) -> tensor | tuple of tensors``), but a model may
return a Hugging Face ``ModelOutput``, a dataclass (diffusers' ``UNet2DOutput``), a dict, or nested
tuples and lists. ``flatten_output`` lists the tensors in a fixed order and records the rest as an
``OutputStructure``, whose ``rebuild`` puts the program's tensors back into an object of the model's
own type, so ``cm(x)`` returns what ``model(x)`` returns.

>>> tensors, structure = flatten_output({"logits": a, "extra": (b, None), "n": 3})
>>> len(tensors), structure.rebuild([x, y])
(2, {'logits': x, 'extra': (y, None), 'n': 3})
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from autoshard.passes.errors import TraceError

__all__ = ["OutputStructure", "flatten_output"]

_CONSTANTS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


class _Tensor:
    """A tensor's position in the flattened output."""
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


@dataclasses.dataclass(frozen=True)
class OutputStructure:
    """The model's output with every tensor replaced by its position: ``rebuild(tensors)`` gives the
    output back with ``tensors[i]`` in position ``i`` (containers of the model's own types)."""
    template: Any
    count: int

    def rebuild(self, tensors) -> Any:
        tensors = list(tensors)
        if len(tensors) != self.count:
            raise ValueError(f"the output structure holds {self.count} tensors, got {len(tensors)}")
        return _fill(self.template, tensors)


def flatten_output(out: Any) -> tuple[list[torch.Tensor], OutputStructure]:
    """``(tensors, structure)`` of a model's output: tensors in depth-first order (mapping and
    dataclass fields in their own order); plain constants (None, numbers, strings) stay in the
    structure. Other objects (a Hugging Face cache, say) raise ``TraceError`` naming where they are."""
    tensors: list[torch.Tensor] = []
    template = _template(out, tensors, "output")
    return tensors, OutputStructure(template, len(tensors))


def _template(value: Any, tensors: list, where: str) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _Tensor(len(tensors) - 1)
    if isinstance(value, _CONSTANTS):
        return value
    if isinstance(value, Mapping):  # dicts and HF ModelOutputs (an OrderedDict of the fields set)
        return _Rebuild(value, {k: _template(v, tensors, f"{where}[{k!r}]") for k, v in value.items()})
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _template(getattr(value, f.name), tensors, f"{where}.{f.name}")
                  for f in dataclasses.fields(value)}
        return _Rebuild(value, fields)
    if isinstance(value, (tuple, list)):
        return _Rebuild(value, [_template(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)])
    raise TraceError(
        f"the model's {where} is a {type(value).__name__}; a forward-only program returns tensors in tuples, "
        f"lists, dicts, dataclasses and Hugging Face ModelOutputs (and plain constants): return tensors "
        f"instead (for a Hugging Face cache, pass use_cache=False), or give loss_fn= to train on the output")


class _Rebuild:
    """A container of the output: its type and its items' templates (no reference to the traced
    values, which are fake or meta tensors)."""
    __slots__ = ("kind", "items")

    def __init__(self, original: Any, items):
        self.kind, self.items = type(original), items


def _fill(template: Any, tensors: list) -> Any:
    if isinstance(template, _Tensor):
        return tensors[template.index]
    if not isinstance(template, _Rebuild):
        return template
    kind = template.kind
    if isinstance(template.items, dict):
        values = {k: _fill(v, tensors) for k, v in template.items.items()}
        if dataclasses.is_dataclass(kind):  # HF ModelOutput (the fields set) and plain dataclasses
            init = {f.name for f in dataclasses.fields(kind) if f.init}
            new = kind(**{k: v for k, v in values.items() if k in init})
            for name, v in values.items():
                if name not in init:
                    object.__setattr__(new, name, v)
            return new
        try:
            return kind(values)
        except TypeError:  # a mapping type without a mapping constructor: a plain dict
            return dict(values)
    values = [_fill(v, tensors) for v in template.items]
    if issubclass(kind, tuple) and hasattr(kind, "_fields"):  # a namedtuple
        return kind(*values)
    return kind(values)
