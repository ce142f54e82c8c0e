"""What model to plan for: a shipped preset, an HF config JSON, or ``module:factory``.

Every source becomes a ``ModelSource``: a builder that makes the model with a given number of
layers (so the planner can compile one or two layers and scale), called under a fake tensor
mode so no parameter is allocated. The built module's ``forward(input_ids, labels)`` returns
the loss, which is what AutoSP compiles.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autosp.errors import ConfigError

PRESETS_FILE = Path(__file__).with_name("presets.json")


def presets() -> dict[str, dict[str, Any]]:
    """Shipped HF configs by name (numbers copied from the Hub; source in the file)."""
    data = json.loads(PRESETS_FILE.read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


@dataclass(frozen=True)
class ModelSource:
    """A model the planner can build with any number of layers.

    Attributes:
        name: what the user gave.
        layers: layers of the real model.
        build: ``build(layers)`` returns the module (called under a fake mode, default dtype set).
        scalable: whether ``build`` honours ``layers`` (else the whole model is compiled).
        heads: query heads (for the variants' divisibility), 0 when unknown.
    """

    name: str
    layers: int
    build: Callable[[int], nn.Module]
    scalable: bool = True
    heads: int = 0


class CausalLMLoss(nn.Module):
    """An HF causal LM behind ``(input_ids, labels) -> loss`` (labels shifted inside, no KV cache)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, labels=labels, use_cache=False).loss


CAUSAL_ATTENTION = "autosp_causal"


def _register_causal_attention() -> None:
    """HF attention that is SDPA with ``is_causal=True`` and no mask tensor.

    Under torch.compile, transformers before torch 2.14 builds the ``[S, S]`` causal mask as a
    tensor (it cannot tell compiling from exporting); a long-context run would not keep it, and
    ring attention refuses it. Planned models have no padding, so the causal flag says it all.
    """
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CAUSAL_ATTENTION, sdpa_attention_forward)
    AttentionMaskInterface.register(CAUSAL_ATTENTION, lambda *args, **kwargs: None)


def _hf_source(name: str, fields: dict[str, Any]) -> ModelSource:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(fields)
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise ConfigError(f"model {name!r}: the config has no 'model_type'; give an HF config.json")
    layers = int(fields.get("num_hidden_layers", 0))
    if layers < 1:
        raise ConfigError(f"model {name!r}: num_hidden_layers must be >= 1 (got {layers})")

    def build(n: int) -> nn.Module:
        cfg = AutoConfig.for_model(model_type, **{**fields, "num_hidden_layers": n})
        cfg.use_cache = False
        _register_causal_attention()
        cfg._attn_implementation = CAUSAL_ATTENTION  # F.scaled_dot_product_attention, which AutoSP finds
        return CausalLMLoss(AutoModelForCausalLM.from_config(cfg))

    return ModelSource(name, layers, build, True, int(fields.get("num_attention_heads", 0)))


def _factory_source(spec: str) -> ModelSource:
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"model {spec!r}: cannot import {attr!r} from {module_name!r} ({e})") from e
    return factory_source(spec, factory)


def factory_source(name: str, factory: Callable[..., nn.Module], layers: int | None = None) -> ModelSource:
    """A source from a callable; it is scaled by layers when it takes a ``layers`` keyword and ``layers`` is known."""
    takes_layers = "layers" in inspect.signature(factory).parameters
    if takes_layers and layers is not None:
        return ModelSource(name, layers, lambda n: factory(layers=n), True)
    return ModelSource(name, 1, lambda n: factory(), False)


def resolve_model(spec: str) -> ModelSource:
    """``llama-3.1-8b`` (a preset), ``path/config.json`` (HF), or ``package.module:factory``."""
    shipped = presets()
    if spec in shipped:
        return _hf_source(spec, shipped[spec])
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json":
        if not path.is_file():
            raise ConfigError(f"model config {str(path)!r} does not exist")
        try:
            fields = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"model config {str(path)!r} is not valid JSON: {e}") from e
        return _hf_source(spec, fields)
    if ":" in spec:
        return _factory_source(spec)
    raise ConfigError(
        f"unknown model {spec!r}; give a preset ({', '.join(sorted(shipped))}), an HF config.json, "
        "or an importable module:factory"
    )


__all__ = ["CausalLMLoss", "ModelSource", "factory_source", "presets", "resolve_model"]
