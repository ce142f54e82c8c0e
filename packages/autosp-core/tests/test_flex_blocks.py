"""The block mask cut to a rank's rows or heads means, element by element, what the whole one meant there.

A block mask means: in a (query block, key block) tile listed as full every pair attends; in one
listed as partial a pair attends where ``mask_mod`` says so; in any other none does. Flex's own
reference math (eager, ``aot_eager``) reads ``mask_mod`` only, so a wrong block list would pass an
end-to-end check there; these tests read the lists, as the kernels do.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import _ordered_to_dense, _transpose_ordered, create_block_mask

from autosp import flex_blocks
from autosp.sharding.placement import even_ranges, zigzag_ranges

LENGTH, HEADS = 120, 4  # the last query block of 16 is partial


def _docs(length: int) -> torch.Tensor:
    docs = (torch.arange(length) * 3) // length
    docs[length // 3 - 2] = 1
    return docs


def _mask(kind: str, length: int = LENGTH, size: int = 16):
    docs = _docs(length)
    fns = {
        "documents": (lambda b, h, q, k: (docs[q] == docs[k]) & (k <= q), None),
        "window": (lambda b, h, q, k: (q - k).abs() < 40, None),
        "per_head": (lambda b, h, q, k: torch.where(h < 2, docs[q] == docs[k], q - k < 24) & (k <= q), HEADS),
    }
    fn, heads = fns[kind]
    return create_block_mask(fn, None, heads, length, length, device="cpu", BLOCK_SIZE=size).as_tuple()


def _meaning(block: tuple, heads: int) -> torch.Tensor:
    """[1, H, Q, K] booleans: which pairs attend, read from the block lists and ``mask_mod``."""
    q_len, kv_len, q_size, kv_size = block[0], block[1], block[14], block[15]
    kv_blocks = block[3].shape[-1]
    partial = _ordered_to_dense(block[2], block[3], kv_blocks).bool()
    full = _ordered_to_dense(block[4], block[5], kv_blocks).bool() if block[4] is not None else partial & False
    q, k = torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :]
    h = torch.arange(heads)[:, None, None]
    tile = (..., q // q_size, k // kv_size)
    by_mod = block[16](torch.zeros((), dtype=torch.long), h, q, k).expand(heads, q_len, kv_len)
    part, whole = partial.expand(1, heads, -1, -1)[tile], full.expand(1, heads, -1, -1)[tile]
    return whole | (part & by_mod)


def _transposed_agrees(block: tuple) -> None:
    """The per-key-block lists (the backward's) are the per-query-block ones transposed."""
    for (num, idx), (q_num, q_idx) in (((2, 3), (6, 7)), ((4, 5), (8, 9))):
        rows = _ordered_to_dense(block[num], block[idx], block[idx].shape[-1])
        cols = _ordered_to_dense(block[q_num], block[q_idx], block[q_idx].shape[-1])
        torch.testing.assert_close(cols, rows.transpose(-2, -1))


LAYOUTS = {
    "a partial last block": (((0, 48), (96, 120)), ((48, 96),)),
    "blocks out of order": (((64, 96), (0, 32)), ((32, 64), (96, 120))),
}


@pytest.mark.parametrize("kind", ["documents", "window", "per_head"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_rows_keep_their_meaning(kind, name):
    block, heads = _mask(kind), HEADS
    whole = _meaning(block, heads)
    for pieces in LAYOUTS[name]:
        local = flex_blocks.rows_of(block, pieces)
        assert local is not None and local[0] == sum(hi - lo for lo, hi in pieces)
        rows = torch.cat([torch.arange(lo, hi) for lo, hi in pieces])
        assert torch.equal(_meaning(local, heads), whole[..., rows, :]), pieces
        _transposed_agrees(local)


def test_rows_on_even_chunks_of_whole_blocks():
    block = _mask("documents", 128)
    whole = _meaning(block, 1)
    layouts = [even_ranges(128, w) for w in (2, 4, 8)] + [zigzag_ranges(128, w) for w in (2, 4)]
    for layout in layouts:
        for pieces in layout:
            local = flex_blocks.rows_of(block, pieces)
            rows = torch.cat([torch.arange(lo, hi) for lo, hi in pieces])
            assert torch.equal(_meaning(local, 1), whole[..., rows, :]), pieces


def test_rows_that_cut_a_block_are_refused():
    block = _mask("documents")
    assert flex_blocks.rows_of(block, ((0, 56),)) is None  # 56 is inside the fourth block of 16
    assert flex_blocks.rows_of(block, ((8, 48),)) is None
    # A partial block is whole only as the sequence's last: not followed by another piece.
    assert flex_blocks.rows_of(block, ((96, 120), (0, 16))) is None
    assert flex_blocks.row_blocks(((96, 120), (0, 16)), 120, 16) is None
    assert flex_blocks.row_blocks(((0, 16), (96, 120)), 120, 16) == [(0, 1), (6, 2)]


def test_a_write_order_is_a_field_not_known():
    block = list(_mask("documents"))
    block[10] = torch.zeros(1)
    assert flex_blocks.rows_of(tuple(block), ((0, 64),)) is None
    assert flex_blocks.heads_of(tuple(block), 1, 0, 1) is None


def test_heads_keep_their_meaning():
    block = _mask("per_head")
    whole = _meaning(block, HEADS)
    for lo, hi in ((0, 2), (2, 4), (1, 3)):
        local = flex_blocks.heads_of(block, HEADS, lo, hi)
        assert torch.equal(_meaning(local, hi - lo), whole[:, lo:hi]), (lo, hi)
    # Heads, then rows (hybrid): both shifts compose.
    local = flex_blocks.rows_of(flex_blocks.heads_of(block, HEADS, 2, 4), ((32, 64),))
    assert torch.equal(_meaning(local, 2), whole[:, 2:4, 32:64])


def test_padding_heads_mean_the_last_real_head():
    # 4 heads padded to 6 (over 3 ranks): the third rank's two heads are padding, the second's second
    # too under 3 heads padded to 4. Each padding head's blocks and mask_mod index are the last real head's.
    block = _mask("per_head")
    whole = _meaning(block, HEADS)
    local = flex_blocks.heads_of(block, HEADS, 4, 6)
    assert torch.equal(_meaning(local, 2), whole[:, [3, 3]])
    local = flex_blocks.heads_of(block, HEADS, 2, 5)
    assert torch.equal(_meaning(local, 3), whole[:, [2, 3, 3]])
    clamped = flex_blocks.offset(2, heads=4)
    assert torch.equal(clamped(torch.arange(4)), torch.tensor([2, 3, 3, 3]))
    assert torch.equal(flex_blocks.offset(2)(torch.arange(4)), torch.tensor([2, 3, 4, 5]))


def test_blocks_cut_inside_a_graph_reach_inductors_kernel_whole():
    # Cut inside the compiled graph, as the variants cut them: rows from a block past the first (the
    # second ring span of hybrid, a contiguous ring piece) and heads past the first. Inductor's CPU
    # Flex kernel once read a block tensor cut by one narrow() past block 0 wrongly: wrong rows.
    import torch._inductor.config as inductor_config
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, LENGTH, 8) for _ in range(3))
    whole = _mask("per_head")
    reference = flex_attention(
        q, k, v, block_mask=BlockMask((whole[0], whole[1]), *whole[2:10], BLOCK_SIZE=(16, 16), mask_mod=whole[16])
    )
    rows, (lo, hi) = (64, LENGTH), (2, 4)

    def cut(q, k, v, *block):
        local = flex_blocks.rows_of(flex_blocks.heads_of(block, HEADS, lo, hi), (rows,))
        mask = BlockMask((local[0], local[1]), *local[2:10], BLOCK_SIZE=(local[14], local[15]), mask_mod=local[16])
        return flex_attention(q, k, v, block_mask=mask)

    torch._dynamo.reset()
    # Inductor's CPU Flex kernel has vectorized code only (the suite's scalar setting breaks it). The
    # vector ISAs Inductor finds are cached at its first compile in the process: found again here, and
    # forgotten after, so the suite's later compiles keep finding none. Compiled afresh: a cached
    # graph was built under another ISA than this process now has (it compiled wrong, or not at all).
    valid_vec_isa_list.cache_clear()
    vectorized = {"cpp.simdlen": None, "cpp.vec_isa_ok": None, "fx_graph_cache": False}
    try:
        with inductor_config.patch(vectorized), torch._functorch.config.patch(enable_autograd_cache=False):
            compiled = torch.compile(cut, backend="inductor", fullgraph=True)
            got = compiled(q[:, lo:hi, rows[0] : rows[1]], k[:, lo:hi], v[:, lo:hi], *whole)
    finally:
        valid_vec_isa_list.cache_clear()
    torch.testing.assert_close(got, reference[:, lo:hi, rows[0] : rows[1]], rtol=1e-5, atol=1e-5)


def test_transpose_matches_torch():
    torch.manual_seed(0)
    dense = torch.rand(2, 3, 5, 7) < 0.4
    num = dense.sum(-1).to(torch.int32)
    idx = torch.argsort(dense.int(), dim=-1, descending=True, stable=True).to(torch.int32)
    ours, theirs = flex_blocks._transpose(num, idx), _transpose_ordered(num, idx)
    assert torch.equal(ours[0], theirs[0])
    # Entries past a column's count are padding, in whatever order.
    used = torch.arange(5) < ours[0][..., None]
    assert torch.equal(ours[1][used], theirs[1][used])


def test_global_rows():
    to_global = flex_blocks.global_rows(((64, 96), (0, 32)))
    local = torch.arange(64)
    assert torch.equal(to_global(local), torch.cat([torch.arange(64, 96), torch.arange(0, 32)]))
    assert torch.equal(flex_blocks.global_rows(((48, 96),))(torch.arange(3)), torch.tensor([48, 49, 50]))
