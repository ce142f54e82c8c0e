"""ParameterCheck on threads joined by torch's threaded process group (real collectives)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from autosp.param_check import ParameterCheck, ParameterMismatch, state_name
from autosp.sample_digest import SAMPLE
from autosp.sharding.testing.threads import collectives_issued, simulate


def _weights(rank: int, differ_on: tuple[int, ...]) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    named = [("embed.weight", torch.randn(96, 16, generator=gen)), ("inv_freq", torch.arange(8.0))]
    big = torch.randn(3, SAMPLE + 7, generator=gen)
    if rank in differ_on:
        big[1, 5:] += 1e-6  # a few elements off is missed by no evenly spread sample of this size
    return [*named, ("blocks.0.q.weight", big)]


def _run(world: int, differ_on: tuple[int, ...]) -> list[tuple[str, str, list[str]]]:
    def rank_fn(rank: int, _: str) -> tuple[str, str, list[str]]:
        try:
            ParameterCheck(dist.group.WORLD)(_weights(rank, differ_on))
            return "ok", "", collectives_issued()
        except ParameterMismatch as e:
            return "mismatch", str(e), collectives_issued()

    return simulate(rank_fn, world)


@pytest.mark.parametrize("world", [2, 4])
def test_equal_weights_pass_with_one_small_all_gather(world: int) -> None:
    def one_all_gather(rank: int, _: str) -> list[str]:
        dist.all_gather_single(torch.zeros(world, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
        return collectives_issued()

    digest_only = simulate(one_all_gather, world)[0]  # as the threaded group logs it
    for kind, _, issued in _run(world, ()):
        assert kind == "ok"
        assert issued == digest_only


def test_different_weights_are_named_on_every_rank() -> None:
    results = _run(3, (1,))
    messages = {message for _, message, _ in results}
    assert [kind for kind, _, _ in results] == ["mismatch"] * 3 and len(messages) == 1
    (message,) = messages
    assert "hold different parameters or buffers, 1 of 3 that this graph reads" in message
    assert "  blocks.0.q.weight: ranks [0, 2] / rank 1\n" in message
    assert "embed.weight" not in message
    assert "torch.manual_seed" in message and "check_inputs='shapes' or 'off'" in message


@pytest.mark.parametrize(
    ("placeholder", "name"),
    [
        ("L_self_modules_blocks_modules_0_modules_q_parameters_weight_", "blocks.0.q.weight"),
        ("L_self_buffers_inv_freq_", "inv_freq"),
        ("L_self_modules_embed_parameters_weight_", "embed.weight"),
        ("L_fn_parameters_scale_", "fn.scale"),
        ("G_TABLE_", "TABLE (a global)"),
    ],
)
def test_state_names_read_like_the_model(placeholder: str, name: str) -> None:
    assert state_name(placeholder) == name


def test_state_digest_reads_every_tensor_afresh_at_every_call() -> None:
    from autosp import param_check

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    digest = param_check.StateDigest(model)
    first = digest.fingerprints()
    assert [n for n, _ in first] == [
        "0.weight",
        "0.bias",
        "1.weight",
        "1.bias",
        "1.running_mean",
        "1.running_var",
        "1.num_batches_tracked",
    ]
    assert digest.fingerprints() == first
    assert param_check.StateDigest(copy.deepcopy(model)).fingerprints() == first  # equal copies agree
    changes = [
        lambda: model[0].weight.data.add_(1.0),  # through .data: no version counter moves
        lambda: model[0].bias.data.copy_(torch.randn(4)),
        lambda: setattr(model[0].bias, "data", torch.zeros(4)),  # new storage under the same Parameter
        lambda: model[1].running_var.mul_(2.0),
        lambda: model[1].num_batches_tracked.add_(1),
    ]
    changed = [n for n, _ in first[:2]] + ["0.bias", "1.running_var", "1.num_batches_tracked"]
    for change, name in zip(changes, changed):
        before = dict(digest.fingerprints())
        with torch.no_grad():
            change()
        after = dict(digest.fingerprints())
        assert [n for n in before if before[n] != after[n]] == [name]


def test_sample_fingerprints_tell_each_element_and_swaps_apart() -> None:
    from autosp.sample_digest import sample_fingerprints

    gen = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(3, 5, generator=gen),
        torch.randn(40, SAMPLE // 8, generator=gen).to(torch.bfloat16),
        torch.randint(0, 9, (7,), generator=gen),
        torch.rand(6, generator=gen) > 0.5,
        torch.randn(4, 2, generator=gen, dtype=torch.complex64),
        torch.randn(8, 6, generator=gen).t(),  # not contiguous
        torch.zeros(0),
    ]
    base = sample_fingerprints(tensors)
    assert base == [sample_fingerprints([t])[0] for t in tensors]  # the same alone or batched
    for i, t in enumerate(tensors[:-1]):
        if i == 1:  # sampled: the spread takes its first element, the row sample one of every row
            other = t.clone()
            other[-1] += 1
            fps = sample_fingerprints([*tensors[:1], other, *tensors[2:]])
            assert [j for j in range(len(tensors)) if fps[j] != base[j]] == [1]
            continue
        for where in (0, t.numel() - 1):
            other = t.clone()
            flat = other.view(-1) if other.is_contiguous() else other.t().reshape(-1)
            flat[where] = ~flat[where] if flat.dtype == torch.bool else flat[where] + 1
            if not other.is_contiguous():
                other = flat.view(other.t().shape).t()
            fps = sample_fingerprints([*tensors[:i], other, *tensors[i + 1 :]])
            assert [j for j in range(len(tensors)) if fps[j] != base[j]] == [i], (i, where)
    swapped = tensors[0].clone()
    swapped[0, 0], swapped[0, 1] = tensors[0][0, 1], tensors[0][0, 0]
    assert sample_fingerprints([swapped])[0] != base[0]


def test_a_row_added_to_a_table_is_compared() -> None:
    # resize_token_embeddings on ranks seeded apart: the new token's row differs in every element,
    # and an evenly spread sample of a [32000, 4096] table misses one row most of the time.
    from autosp.input_check import spread_sample
    from autosp.sample_digest import sample, sample_fingerprints

    table = torch.zeros(32001, 64)
    other = table.clone()
    other[-1] = torch.randn(64)
    assert torch.equal(spread_sample(table, SAMPLE), spread_sample(other, SAMPLE))  # the spread alone misses it
    assert sample_fingerprints([table]) != sample_fingerprints([other])
    assert sample(table).numel() <= SAMPLE + table.shape[0]
    assert torch.equal(sample(torch.arange(10.0)), torch.arange(10.0).view(torch.int32))  # small: all of it
