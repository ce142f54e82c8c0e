"""The Ulysses variant as registered: found through its entry point, and its compile-time check."""

from __future__ import annotations

import pytest

from autosp import AutoSPError
from autosp.analysis.attention import AttentionSite
from autosp.lowering import SDPA
from autosp.registry import build_registry
from autosp_ulysses import ULYSSES


def _site(heads: int, kv_heads: int) -> AttentionSite:
    return AttentionSite("sdpa", SDPA, 1, heads, kv_heads, 64, 64, 16, True, None, None)


def test_registered_through_the_entry_point():
    reg = build_registry()
    assert reg.variant("ulysses") is ULYSSES
    assert "autosp-ulysses" in reg.plugin_names()


def test_heads_must_divide_sp_size_with_a_pointer_to_ring():
    ULYSSES.check(_site(8, 2), 4)  # 2 kv heads on 4 ranks are replicated, not an error
    with pytest.raises(AutoSPError, match=r"6 query heads, not divisible by sp_size=4.*variant='ring'"):
        ULYSSES.check(_site(6, 2), 4)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_ulysses_chunks_is_checked(bad):
    from autosp import ConfigError
    from autosp_ulysses.attention import chunk_option

    assert chunk_option({}) == 1 and chunk_option({"ulysses_chunks": 3}) == 3
    with pytest.raises(ConfigError, match=r"ulysses_chunks=.*use an int >= 1"):
        chunk_option({"ulysses_chunks": bad})
