"""A Dynamo fix that AutoSP's nested graph breaks need and torch 2.13 lacks.

AutoSP turns on Dynamo's nested graph breaks (``guards._hard_dynamo_failures``). In torch 2.13,
Dynamo reads a module's empty hook dict (``_forward_hooks`` and its kin) as a fresh dict that
names no source. A module hook registered inside the compiled call then breaks the graph inside
``RemovableHandle.__init__``, and the resumed code is handed that fresh dict instead of the
module's own: ``weakref.ref`` of a plain dict raises ``TypeError: cannot create weak reference to
'dict' object``. Transformers 5 registers its output-capturing hooks so on the first call of a
model asked for ``output_hidden_states`` or ``output_attentions`` (Wav2Vec2's classifiers ask by
default): plain ``torch.compile`` ran them, AutoSP crashed.

Upstream fixed it by giving that dict its attribute source (pytorch/pytorch#191388): resumed code
then loads the module's own dict, so the hook is registered where eager registers it and its
handle removes it. ``install`` does the same on releases without the fix, and nothing where the
dict already has a source.
"""

from __future__ import annotations

from typing import Any

_HOOK_DICTS = frozenset(
    {
        "_backward_hooks",
        "_backward_pre_hooks",
        "_forward_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs",
    }
)
_installed = False


def install() -> None:
    """Give Dynamo's empty module hook dicts their attribute source (once per process)."""
    global _installed
    if _installed:
        return
    _installed = True
    try:
        from torch._dynamo.source import AttrSource
        from torch._dynamo.variables import ConstDictVariable
        from torch._dynamo.variables.nn_module import UnspecializedNNModuleVariable
    except ImportError:  # a release whose Dynamo is laid out otherwise: nothing known to fix
        return
    read = UnspecializedNNModuleVariable.var_getattr

    def var_getattr(self: Any, tx: Any, name: str) -> Any:
        vt = read(self, tx, name)
        if (
            name in _HOOK_DICTS
            and self.source is not None
            and type(vt) is ConstDictVariable
            and vt.source is None
            and not vt.items
        ):
            return ConstDictVariable({}, source=AttrSource(self.source, name))
        return vt

    UnspecializedNNModuleVariable.var_getattr = var_getattr  # type: ignore[method-assign]


__all__ = ["install"]
