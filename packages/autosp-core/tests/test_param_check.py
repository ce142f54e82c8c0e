"""ParameterCheck on threads joined by torch's threaded process group (real collectives)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autosp.param_check import SAMPLE, ParameterCheck, ParameterMismatch, state_name
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


def test_state_digest_refingerprints_only_what_changed(monkeypatch) -> None:
    from autosp import param_check

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    digest = param_check.StateDigest(model)
    calls: list[tuple[int, ...]] = []
    real = param_check.fingerprint
    monkeypatch.setattr(param_check, "fingerprint", lambda t: calls.append(tuple(t.shape)) or real(t))
    first = digest.fingerprints()
    names = [n for n, _ in first]
    assert names == [
        "0.weight",
        "0.bias",
        "1.weight",
        "1.bias",
        "1.running_mean",
        "1.running_var",
        "1.num_batches_tracked",
    ]
    assert len(calls) == len(names)
    calls.clear()
    assert digest.fingerprints() == first and calls == []  # nothing changed: nothing recomputed
    with torch.no_grad():
        model[0].weight.add_(1.0)  # in place: its version moves
    second = dict(digest.fingerprints())
    assert calls == [(16,)] and second["0.weight"] != dict(first)["0.weight"]
    calls.clear()
    model[0].bias.data = torch.zeros(4)  # new storage under the same Parameter
    assert dict(digest.fingerprints())["0.bias"] != dict(first)["0.bias"] and calls == [(4,)]


def test_a_row_added_to_a_table_is_compared() -> None:
    # resize_token_embeddings on ranks seeded apart: the new token's row differs in every element,
    # and an evenly spread sample of a [32000, 4096] table misses one row most of the time.
    from autosp.input_check import spread_sample
    from autosp.param_check import sample

    table = torch.zeros(32001, 64)
    other = table.clone()
    other[-1] = torch.randn(64)
    assert torch.equal(spread_sample(table, SAMPLE), spread_sample(other, SAMPLE))  # what was compared
    assert not torch.equal(sample(table), sample(other))
    assert sample(table).numel() <= SAMPLE + table.shape[0]
    assert torch.equal(sample(torch.arange(10.0)), torch.arange(10.0))  # small: all of it


def test_a_new_tensor_where_the_last_one_was_is_fingerprinted_anew() -> None:
    """Gradients made anew each step can land at the address of the last ones, at version 0: the
    cache must not take the new tensor for the old (a whole step compiled with AdamW was refused)."""
    from autosp.param_check import FingerprintCache

    cache = FingerprintCache()
    grad = torch.zeros(64)
    (first,) = cache([("w.grad", grad)])
    grad.data.fill_(1.0)  # new contents without a new version: as a fresh tensor at that address
    again = grad.view(64)  # another tensor object, same address, same version counter
    (second,) = cache([("w.grad", again)])
    assert first != second
    assert cache([("w.grad", again)]) == [second]  # the same tensor again: from the cache
