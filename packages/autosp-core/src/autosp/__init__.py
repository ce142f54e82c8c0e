"""AutoSP: sequence parallelism as a compiler pass.

import autosp
compiled = autosp.compile(model, sp_size=2)   # every rank: same full-length inputs
loss = compiled(input_ids, labels)             # the single-device loss
loss.backward()                                # the single-device gradients
"""

from importlib import metadata as _metadata

from autosp.analysis.attention import AttentionSite, AttentionSpec
from autosp.api import AutoSPBackend, backend, compile, explain
from autosp.compile_agreement import CollectiveMismatch, CompileFailed, ProgramMismatch
from autosp.errors import AutoSPError, ConfigError, PeerFailed, VerificationError
from autosp.guards import (
    AttentionNotSharded,
    CollectiveFailure,
    EagerFallback,
    GradientMismatch,
    InputMismatch,
    NotSequenceParallel,
    RanInEager,
    StepMismatch,
)
from autosp.hardware import HardwareProfile
from autosp.hookspecs import hookimpl
from autosp.options import SPOptions
from autosp.param_check import ParameterMismatch
from autosp.passes.manager import Pass, Stage
from autosp.plan import plan  # the function: autosp.plan(model, gpus=..., hardware=...)
from autosp.report import Report
from autosp.rng_check import RandomStateMismatch
from autosp.variants import SPVariant
from autosp.verify import VerifyReport, verify
from autosp.whole import CompileCrashed, CompiledWhole

try:
    # pyproject.toml is the one version source; the installed metadata carries it.
    __version__ = _metadata.version("autosp-core")
except (
    _metadata.PackageNotFoundError
):  # a source tree on sys.path, not installed (its plugins' entry points are missing too)
    __version__ = "0+unknown"

__all__ = [
    "AttentionNotSharded",
    "AttentionSite",
    "AttentionSpec",
    "AutoSPBackend",
    "AutoSPError",
    "CollectiveFailure",
    "CompileCrashed",
    "CompileFailed",
    "CompiledWhole",
    "ConfigError",
    "EagerFallback",
    "HardwareProfile",
    "GradientMismatch",
    "InputMismatch",
    "NotSequenceParallel",
    "ParameterMismatch",
    "PeerFailed",
    "ProgramMismatch",
    "CollectiveMismatch",
    "RanInEager",
    "StepMismatch",
    "RandomStateMismatch",
    "Pass",
    "Report",
    "SPOptions",
    "SPVariant",
    "Stage",
    "VerificationError",
    "VerifyReport",
    "backend",
    "compile",
    "explain",
    "hookimpl",
    "plan",
    "verify",
]
