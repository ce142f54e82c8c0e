"""Test support shared by every AutoSP package and tool: tiny models and the saved-bytes measurement.

Public so that plugin authors test against the same models: ``from autosp.testing import LlamaLike``.
"""

from autosp.testing.memory import SavedBytes
from autosp.testing.models import (
    Config,
    GPT2Block,
    GPT2Like,
    LlamaBlock,
    LlamaLike,
    MeanPoolClassifier,
    RMSNorm,
    hf_causal_lm,
    rope,
)

__all__ = [
    "Config",
    "GPT2Block",
    "GPT2Like",
    "LlamaBlock",
    "LlamaLike",
    "MeanPoolClassifier",
    "RMSNorm",
    "SavedBytes",
    "hf_causal_lm",
    "rope",
]
