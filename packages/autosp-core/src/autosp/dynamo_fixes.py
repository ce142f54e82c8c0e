"""Three Dynamo fixes that AutoSP's programs need and torch 2.13 lacks, in force inside ``applied()``.

They hold only while ``applied()`` is entered (AutoSP's guarded call holds it with nested graph breaks
on): another ``torch.compile`` in the process traces as torch alone would. The values-view fix turns
into a graph break a frame that plain Dynamo compiles (one that takes only the view's length), and
``fullgraph=True`` then fails on it; the fixes must not reach programs that did not ask for AutoSP.

**Module hook dicts.** AutoSP turns on Dynamo's nested graph breaks (``guards._hard_dynamo_failures``).
In torch 2.13, Dynamo reads a module's empty hook dict (``_forward_hooks`` and its kin) as a fresh
dict that names no source. A module hook registered inside the compiled call then breaks the graph
inside ``RemovableHandle.__init__``, and the resumed code is handed that fresh dict instead of the
module's own: ``weakref.ref`` of a plain dict raises ``TypeError: cannot create weak reference to
'dict' object``. Transformers 5 registers its output-capturing hooks so on the first call of a
model asked for ``output_hidden_states`` or ``output_attentions`` (Wav2Vec2's classifiers ask by
default): plain ``torch.compile`` ran them, AutoSP crashed. Upstream fixed it by giving that dict
its attribute source (pytorch/pytorch#191388): resumed code then loads the module's own dict, so the
hook is registered where eager registers it and its handle removes it. ``install`` does the same on
releases without the fix, and nothing where the dict already has a source.

**An ``OrderedDict``'s values view as a frame's input.** Dynamo takes ``od.values()`` for a list and
guards its items as ``view[i]``, which a view does not support: building the guards raised
``InternalTorchDynamoError: 'odict_values' object is not subscriptable``, for plain ``torch.compile``
too (a function given ``od.values()``). Nested graph breaks make such views frame inputs in ordinary
programs: a break in code that holds one (``inspect.Signature.bind`` iterates
``parameters.values()``; transformers 5 binds its decorated forwards so, and installs its
output-capturing hooks under a lock, a break, on the first call) resumes in a frame whose inputs
include the view. LLaVA crashed so on its first call. ``install`` makes such a view a graph break
where the frame reads it: that part of the frame runs in eager, which works on a view; the view
never reaches the guards.

**A graph break inside a comprehension.** Before Python 3.12 a comprehension is a function of its own
(``<listcomp>``), whose iterator is the local ``.0``. With nested graph breaks Dynamo resumed a break
inside one in a frame without that local: ``UnboundLocalError: cannot access local variable '.0'``
when the resumed code ran. Pixtral's vision tower (Mistral-3) slices each image's patches by a
tensor size in a list comprehension, a break; it crashed so. ``install`` lets no comprehension hold
a nested break before 3.12: the break falls to the call of the comprehension in the enclosing
function, which resumes after it, as for any call Dynamo cannot inline; the comprehension runs in eager.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from contextvars import ContextVar
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
# A context variable: Dynamo traces in the calling thread, and another thread's compile is not AutoSP's.
_IN_FORCE: ContextVar[bool] = ContextVar("autosp_dynamo_fixes", default=False)


def install() -> None:
    """Patch Dynamo once per process; the patches do nothing outside ``applied()``."""
    global _installed
    if _installed:
        return
    _installed = True
    _source_hook_dicts()
    _break_at_values_views()
    _no_nested_breaks_in_comprehensions()


@contextlib.contextmanager
def applied() -> Iterator[None]:
    """The three fixes in force for what Dynamo traces in this context (installed on first use)."""
    install()
    token = _IN_FORCE.set(True)
    try:
        yield
    finally:
        _IN_FORCE.reset(token)


def _source_hook_dicts() -> None:
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
            _IN_FORCE.get()
            and name in _HOOK_DICTS
            and self.source is not None
            and type(vt) is ConstDictVariable
            and vt.source is None
            and not vt.items
        ):
            return ConstDictVariable({}, source=AttrSource(self.source, name))
        return vt

    UnspecializedNNModuleVariable.var_getattr = var_getattr  # type: ignore[method-assign]


def _break_at_values_views() -> None:
    try:
        from torch._dynamo.exc import unimplemented
        from torch._dynamo.utils import odict_values
        from torch._dynamo.variables.builder import VariableBuilder
    except ImportError:
        return
    wrap = VariableBuilder.wrap_listlike

    def wrap_listlike(self: Any, value: Any) -> Any:
        if type(value) is odict_values and _IN_FORCE.get():
            unimplemented(
                gb_type="OrderedDict values view as an input (autosp.dynamo_fixes)",
                context=repr(self.source),
                explanation="Dynamo would guard the view's items by index, which a values view does not support",
                hints=["Pass list(od.values()) instead of the view"],
            )
        return wrap(self, value)

    VariableBuilder.wrap_listlike = wrap_listlike  # type: ignore[method-assign]


_COMPREHENSIONS = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"})


def _no_nested_breaks_in_comprehensions() -> None:
    if sys.version_info >= (3, 12):  # comprehensions run inside their function's frame (PEP 709)
        return
    try:
        from torch._dynamo.variables.functions import BaseUserFunctionVariable, UserFunctionVariable
    except ImportError:
        return
    for cls in (BaseUserFunctionVariable, UserFunctionVariable):
        allowed = cls.__dict__.get("should_allow_nested_graph_breaks")
        if allowed is None:
            continue

        def should_allow_nested_graph_breaks(self: Any, allowed: Any = allowed) -> bool:
            try:
                name = self.get_code().co_name
            except Exception:  # noqa: BLE001 - a function variable without code: as torch decides
                return allowed(self)
            return (name not in _COMPREHENSIONS or not _IN_FORCE.get()) and allowed(self)

        cls.should_allow_nested_graph_breaks = should_allow_nested_graph_breaks  # type: ignore[method-assign]


__all__ = ["applied", "install"]
