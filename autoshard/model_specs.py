"""Models named on the command line: ``autoshard plan SPEC`` builds what SPEC names, on the meta device.

SPEC is one of

- a Hugging Face ``config.json`` path: the causal-LM class of its ``model_type`` (read as plain JSON,
  no remote code);
- a model type with overrides, ``llama:num_hidden_layers=32,hidden_size=4096`` (values parsed as JSON
  where they parse, else strings): ``transformers.AutoConfig.for_model`` then the causal-LM class;
- ``package.module:factory`` (any name transformers does not know as a model type; importable from
  ``PYTHONPATH`` or the current directory): the factory is called (with whichever of ``batch``, ``seq`` and ``dtype``
  it accepts as keywords) and returns ``(model, example_inputs)`` or ``(model, example_inputs, loss_fn,
  example_target)``; example inputs are a tuple of tensors or a dict of keyword tensors.

A Hugging Face model gets ``input_ids`` of shape (batch, seq) and the next-token cross entropy
(``causal_lm_loss``) with a target of the same shape. Its attention is SDPA when the model accepts it,
else eager (``ATTENTION_IMPLEMENTATIONS``; GPT-OSS refuses SDPA); when it accepts neither, the error
quotes each refusal. ``model_source`` is what a plan file stores so
``autoshard explain`` can build the same model again.
"""
from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["BuiltModel", "build_model", "causal_lm_loss", "DTYPES", "parse_overrides"]

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def causal_lm_loss(output, target: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of a Hugging Face causal-LM output's ``.logits`` (batch, seq, vocab) against
    token ids ``target`` (batch, seq); the loss receives the model's output object, as in PyTorch."""
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


@dataclass
class BuiltModel:
    """A model on the meta device with one global example batch, and how it was named."""
    model: nn.Module
    example_inputs: Any
    loss_fn: Optional[Callable]
    example_target: Optional[torch.Tensor]
    description: str
    source: dict


def parse_overrides(text: str) -> dict:
    """``a=1,b=true,c=gelu`` -> ``{"a": 1, "b": True, "c": "gelu"}``."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        if "=" not in item:
            raise ValueError(f"override {item!r} is not key=value (e.g. num_hidden_layers=32)")
        key, value = item.split("=", 1)
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value.strip()
    return out


#: attention implementations tried in order: SDPA first (what the planner prices as one fused op and
#: may run as ring attention), then eager, for models that refuse SDPA (GPT-OSS's attention sinks)
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")


def _hf_model(config_kwargs: dict, model_type: str, batch: int, seq: int, dtype: torch.dtype) -> nn.Module:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError as e:
        raise ValueError("building a Hugging Face model needs the transformers package (pip install transformers)") from e
    try:
        config = AutoConfig.for_model(model_type, **config_kwargs)
    except ValueError as e:
        raise ValueError(f"transformers knows no model type {model_type!r} ({e})") from e
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"model type {model_type!r} has no causal-LM class in transformers; name a "
                         "package.module:factory instead")
    config.use_cache = False
    return _with_attention(AutoModelForCausalLM, config, model_type).to(dtype)


def _with_attention(auto_class, config, model_type: str) -> nn.Module:
    """``auto_class.from_config(config)`` on the meta device with the first attention implementation of
    ``ATTENTION_IMPLEMENTATIONS`` the model accepts; ValueError with each one's refusal when none is."""
    refused = []
    for implementation in ATTENTION_IMPLEMENTATIONS:
        with torch.device("meta"):
            try:
                return auto_class.from_config(config, attn_implementation=implementation)
            except (ValueError, ImportError) as e:
                refused.append(f"{implementation!r}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    raise ValueError(f"transformers' {model_type!r} causal-LM class accepts none of the attention implementations "
                     f"autoshard can trace ({'; '.join(refused)}); name a package.module:factory that builds it instead")


def _token_batch(batch: int, seq: int) -> tuple[dict, torch.Tensor]:
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return {"input_ids": ids}, torch.empty(batch, seq, dtype=torch.long, device="meta")


def _is_model_type(name: str) -> bool:
    """Whether transformers knows ``name`` as a model type (``llama``, ``gpt2``, ...)."""
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:
        return False
    return name in CONFIG_MAPPING


def build_model(spec: str, *, batch: int, seq: int, dtype: str = "fp32") -> BuiltModel:
    """Build what ``spec`` names (module docstring) with a global batch of ``batch`` x ``seq`` tokens;
    ValueError says what is wrong with the spec."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    source = {"spec": spec, "batch": batch, "seq": seq, "dtype": dtype}
    if spec.endswith(".json") or os.path.isfile(spec):
        try:
            with open(spec, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read {spec} as a JSON config ({e})") from e
        if not isinstance(config, dict) or "model_type" not in config:
            raise ValueError(f"{spec} has no 'model_type': is it a Hugging Face config.json?")
        kwargs = {k: v for k, v in config.items() if k not in ("model_type", "auto_map", "architectures")}
        model = _hf_model(kwargs, config["model_type"], batch, seq, torch_dtype)
        inputs, target = _token_batch(batch, seq)
        return BuiltModel(model, inputs, causal_lm_loss, target, f"{type(model).__name__} from {spec}", source)
    head, _, rest = spec.partition(":")
    if _is_model_type(head) or (not rest and "." not in head) or "=" in rest:
        model = _hf_model(parse_overrides(rest), head, batch, seq, torch_dtype)
        inputs, target = _token_batch(batch, seq)
        return BuiltModel(model, inputs, causal_lm_loss, target, f"{type(model).__name__} ({spec})", source)
    if not rest:
        raise ValueError(f"{spec!r}: name a factory as package.module:function")
    if os.getcwd() not in sys.path:  # as `python -m` would: modules next to where the command runs import
        sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(head), rest)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import {rest!r} from {head!r} ({e}); is the package on PYTHONPATH?") from e
    accepted = inspect.signature(factory).parameters
    offered = {"batch": batch, "seq": seq, "dtype": torch_dtype}
    made = factory(**{k: v for k, v in offered.items() if k in accepted})
    if not isinstance(made, (tuple, list)) or len(made) not in (2, 4):
        raise ValueError(f"{spec} returned {type(made).__name__}; a factory returns (model, example_inputs) or "
                         "(model, example_inputs, loss_fn, example_target)")
    model, inputs, loss_fn, target = (tuple(made) + (None, None))[:4]
    if "dtype" not in accepted:
        model = model.to(torch_dtype)
    return BuiltModel(model, inputs, loss_fn, target, f"{type(model).__name__} from {spec}", source)
