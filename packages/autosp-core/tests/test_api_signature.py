"""The public entry points' keywords: ``CompileOptions`` (what ``explain`` takes) is ``compile``'s signature."""

from __future__ import annotations

import inspect

import autosp
from autosp.api import CompileOptions, TorchCompileOptions, VerifyOptions


def _keywords(fn) -> set[str]:
    return {n for n, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY}


def test_compile_options_name_every_keyword_of_compile():
    assert set(CompileOptions.__optional_keys__) == _keywords(autosp.compile) | TorchCompileOptions.__optional_keys__


def test_verify_takes_compile_keywords_with_its_own_sp_size_and_group():
    own = {"sp_size", "group"}
    assert VerifyOptions.__optional_keys__ == CompileOptions.__optional_keys__ - own
    assert own <= _keywords(autosp.verify)


def test_backend_takes_compile_keywords_but_torch_compile_ones():
    # backend() gets variant options as **kwargs where compile() has variant_options=.
    assert _keywords(autosp.backend) == _keywords(autosp.compile) - {"variant_options"}


def test_torch_compile_options_are_torch_compile_keywords():
    import torch

    accepted = set(inspect.signature(torch.compile).parameters) - {"model", "backend"}
    assert set(TorchCompileOptions.__annotations__) <= accepted, set(TorchCompileOptions.__annotations__) - accepted
