"""Workers for test_guards.py: faults injected into SP runs, each returning what every rank saw and how fast.

Module-level functions, since spawned processes import them by name.
"""

from __future__ import annotations

import contextlib
import copy
import random
import time
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import autosp
from autosp import peer_failure
from autosp.testing.models import Config, LlamaLike


def _llama() -> torch.nn.Module:
    """One layer: the guards act on calls and graphs, not on depth, and each fault compiles anew."""
    torch.manual_seed(0)
    return LlamaLike(Config(layers=1))


def _ids(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 96, (batch, seq), generator=torch.Generator().manual_seed(seed))


class _PooledClassifier(torch.nn.Module):
    """Embedding, dropout, one SDPA head, dropout on the mean-pooled vector, a 4-way classifier."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.embed, self.qkv = torch.nn.Embedding(96, 16), torch.nn.Linear(16, 48)
        self.drop, self.head = torch.nn.Dropout(p), torch.nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.embed(ids))
        q, k, v = self.qkv(x).view(*ids.shape, 3, 2, 8).permute(2, 0, 3, 1, 4)
        x = x + torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return torch.nn.functional.cross_entropy(self.head(self.drop(x.mean(1))), y)


class _Steered(torch.nn.Module):
    """One SDPA layer whose output is scaled by ``scale`` (an attribute, or a settings object's field)."""

    def __init__(self, scale: float, graph_break: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scale, self.graph_break = scale, graph_break
        self.embed, self.qkv, self.head = torch.nn.Embedding(96, 16), torch.nn.Linear(16, 48), torch.nn.Linear(16, 8)

    def forward(self, ids: torch.Tensor, settings: Any = None) -> torch.Tensor:
        x = self.embed(ids)
        q, k, v = self.qkv(x).view(*ids.shape, 3, 2, 8).permute(2, 0, 3, 1, 4)
        x = x + torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        x = x * (self.scale if settings is None else settings.scale)
        if self.graph_break:
            torch._dynamo.graph_break()
            return self.head(x).square().mean()
        return self.head(x).square().mean()


class _PythonRandomScale(_Steered):
    """``_Steered`` scaled by a draw of Python's ``random`` (an augmentation): Dynamo draws it before
    each run and hands it to the graph as an input."""

    def __init__(self) -> None:
        super().__init__(1.0)

    def forward(self, ids: torch.Tensor, settings: Any = None) -> torch.Tensor:
        self.scale = random.uniform(0.5, 1.5)
        return super().forward(ids)


@torch.compiler.disable
def _eager_keep(shape: torch.Size) -> torch.Tensor:
    return torch.rand(shape) < 0.7  # in eager: no graph shows this draw


class _MaskedInEager(torch.nn.Module):
    """Positions dropped by a mask drawn where Dynamo runs eager code: NumPy (Wav2Vec2's SpecAugment,
    BigBird's random blocks), or a ``torch.compiler.disable``'d function; then attention and a loss."""

    def __init__(self, draw: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.draw = draw
        self.embed, self.qkv, self.head = torch.nn.Embedding(96, 16), torch.nn.Linear(16, 48), torch.nn.Linear(16, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        import numpy as np

        if self.draw == "numpy":  # np.random.choice breaks the graph (Dynamo traces np.random.rand as torch's)
            keep = torch.ones(ids.shape, dtype=torch.bool)
            keep[:, torch.from_numpy(np.random.choice(ids.shape[1], ids.shape[1] // 4, replace=False))] = False
        else:
            keep = _eager_keep(ids.shape)
        x = self.embed(ids) * keep[..., None]
        q, k, v = self.qkv(x).view(*ids.shape, 3, 2, 8).permute(2, 0, 3, 1, 4)
        x = x + torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        return self.head(x).square().mean()


def _seed_draw(draw: str, seed: int) -> None:
    import numpy as np

    if draw == "numpy":
        np.random.seed(seed)
    else:
        torch.manual_seed(seed)


GLOBAL_SCALE = torch.ones(16)  # a module-level tensor the forward reads (set per rank by the worker)


class _Attribute(torch.nn.Module):
    """One SDPA layer scaled by a plain tensor attribute (not a buffer) and by a global tensor."""

    def __init__(self, value: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.qkv, self.head = torch.nn.Embedding(96, 16), torch.nn.Linear(16, 48), torch.nn.Linear(16, 8)
        self.table = torch.full((16,), value)  # a plain attribute: neither parameter nor buffer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) * self.table * GLOBAL_SCALE
        q, k, v = self.qkv(x).view(*ids.shape, 3, 2, 8).permute(2, 0, 3, 1, 4)
        x = x + torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        return self.head(x).square().mean()


class _EmptyAcrossBreak(_Attribute):
    """A value made with ``torch.empty_like`` before a graph break and filled after it: the next graph
    reads a local of the call (arbitrary bytes per rank until filled), not a captured tensor."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        q, k, v = self.qkv(x).view(*ids.shape, 3, 2, 8).permute(2, 0, 3, 1, 4)
        x = x + torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        out = torch.empty_like(x)
        torch._dynamo.graph_break()
        out.copy_(x)
        return self.head(out).square().mean()


class _FusedQKV(torch.nn.Module):
    """nanoGPT's attention: one qkv Linear with a bias, viewed [B, S, 3, H, hd]."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(96, 32)
        self.qkv = torch.nn.Linear(32, 96)
        self.head = torch.nn.Linear(32, 96)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        b, s, c = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, c // 4).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head(x + a.transpose(1, 2).reshape(b, s, c)).square().mean()


class _Decoder(torch.nn.Module):
    """One attention layer that returns its keys and values as a cache and attends over a cache passed in."""

    def __init__(self, graph_break: bool = False) -> None:
        super().__init__()
        self.graph_break = graph_break
        self.embed = torch.nn.Embedding(96, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.out = torch.nn.Linear(16, 16)

    def forward(self, ids: torch.Tensor, cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        b, s = ids.shape
        q, k, v = self.qkv(self.embed(ids)).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        if cache is not None:  # every cached position precedes the new tokens
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=cache is None).transpose(1, 2)
        if self.graph_break:  # the head in a graph of its own, its hidden size the prefill's length (16)
            torch._dynamo.graph_break()
        return self.out(o.flatten(2)).square().mean(), torch.stack([k, v]).detach()


def _grad_error(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    """The largest gradient difference between two copies of a model (inf where one got no gradient)."""
    return max(
        float((p.grad - r.grad).abs().max()) if p.grad is not None else float("inf")
        for p, r in zip(model.parameters(), reference.parameters())
    )


def attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn``; the exception's type and text (or "ok") and the seconds it took."""
    start = time.perf_counter()
    try:
        out = fn()
        result = {"error": None, "loss": float(out.detach()) if isinstance(out, torch.Tensor) else None}
    except Exception as e:  # noqa: BLE001 - the test asserts on it
        result = {"error": type(e).__name__, "autosp": isinstance(e, autosp.AutoSPError), "message": str(e)}
    result["seconds"] = time.perf_counter() - start
    return result


def _float_model(**options: Any) -> Any:
    """A model called with embeddings: attention over them and a scalar out."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        q = x.view(2, 16, 2, 4).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).square().mean()

    torch._dynamo.reset()
    return autosp.compile(forward, backend="eager", **options)


def input_faults(rank: int, world: int) -> dict[str, Any]:
    """Ranks fed different inputs, and more shapes than Dynamo's recompile limit."""
    out: dict[str, Any] = {}

    # Options that decide the groups and the per-call exchanges, given differently per rank (once
    # torch's "Wait timeout" at the world's timeout, or a wait in the first collective).
    for option, values in (("sp_size", (2, 1)), ("check_inputs", ("tokens", False)), ("timeout", (None, 60))):
        out[f"options_{option}"] = attempt(lambda: autosp.compile(_llama(), backend="eager", **{option: values[rank]}))

    # More lengths than the recompile limit (lowered to 2 to keep the test short: same mechanism).
    with torch._dynamo.config.patch(recompile_limit=2):
        compiled = autosp.compile(_llama(), backend="eager")
        out["limit"] = [attempt(lambda s=s: compiled(_ids(2, s), _ids(2, s))) for s in (16, 32, 48)]
    out["fail_flag_after"] = torch._dynamo.config.fail_on_recompile_limit_hit

    compiled = autosp.compile(_llama(), backend="eager")
    ids = _ids(2, 64) if rank == 0 else _ids(1, 128)
    out["shapes"] = attempt(lambda: compiled(ids, labels=ids))
    ids = _ids(2, 64) if rank == 0 else _ids(2, 32)
    out["lengths"] = attempt(lambda: compiled(ids, ids))
    # After the errors the ranks are still in step: a good call runs and agrees.
    out["same"] = attempt(lambda: compiled(_ids(2, 64), _ids(2, 64)))
    # Different tokens, same shapes (a data loader sharded over the SP ranks): the default check
    # compares the contents of integer tensors.
    out["tokens_default"] = attempt(lambda: compiled(_ids(2, 64, seed=rank), _ids(2, 64)))
    shapes_only = autosp.compile(_llama(), backend="eager", check_inputs="shapes")
    out["tokens_shapes_mode"] = attempt(lambda: shapes_only(_ids(2, 64, seed=rank), _ids(2, 64)))

    # Floating-point inputs (embeddings) of the same shape: compared by sample by default, whole with "hash".
    emb = torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(rank))
    out["floats_default"] = attempt(lambda: _float_model()(emb))
    out["floats_hash"] = attempt(lambda: _float_model(check_inputs="hash")(emb))
    hashed = autosp.compile(_llama(), backend="eager", check_inputs="hash")
    out["same_hash"] = attempt(lambda: hashed(_ids(2, 64), _ids(2, 64)))

    # Ranks whose weights differ (rank 1's model perturbed, as an unseeded init or a checkpoint
    # loaded on rank 0 only would leave it): the SP program would run and match no model.
    drifted = _llama()
    with torch.no_grad():
        drifted.blocks[0].q.weight.add_(1e-3 * rank)
    out["params_differ"] = attempt(lambda: autosp.compile(drifted, backend="eager")(_ids(2, 32), _ids(2, 32)))
    out["params_differ_shapes_mode"] = attempt(
        lambda: autosp.compile(drifted, backend="eager", check_inputs="shapes")(_ids(2, 32), _ids(2, 32))
    )
    # backward(retain_graph=True) twice through one forward (two losses sharing it), as in eager.
    model, reference = _llama(), _llama()
    loss = autosp.compile(model, backend="aot_eager")(_ids(2, 32), _ids(2, 32))
    ref_loss = reference(_ids(2, 32), _ids(2, 32))
    out["retain_graph"] = attempt(lambda: loss.backward(retain_graph=True) or loss.backward() or loss)
    ref_loss.backward(retain_graph=True)
    ref_loss.backward()
    out["retain_graph_grad"] = _grad_error(model, reference)

    # The model compiled inside non-reentrant torch.utils.checkpoint (its first call under the
    # checkpoint's saved-tensor hooks), then recomputed in the backward: as in eager.
    model, reference = _llama(), _llama()
    out["checkpointed"] = attempt(
        lambda: torch.utils.checkpoint.checkpoint(
            autosp.compile(model, backend="aot_eager"), _ids(2, 32), _ids(2, 32), use_reentrant=False
        ).backward()
    )
    reference(_ids(2, 32), _ids(2, 32)).backward()
    out["checkpointed_grad"] = _grad_error(model, reference)

    # After a sharded call (a prefill), one shorter than sp_size (a decoding step against the cache it
    # returned): it cannot be split, so its graph runs whole on every rank, values and gradients as in eager.
    # With a graph break before the head, the head's graph runs whole too, not sharded by the prefill's length.
    for graph_break in (False, True):
        torch.manual_seed(0)
        model = _Decoder(graph_break)
        reference = copy.deepcopy(model)
        compiled = autosp.compile(model, backend="aot_eager")
        _, cache = compiled(_ids(2, 16))
        prefill = len(compiled.autosp_reports)
        short = _ids(2, world - 1, seed=1)

        def step(compiled: Any = compiled, cache: torch.Tensor = cache, short: torch.Tensor = short) -> torch.Tensor:
            loss, _ = compiled(short, cache)
            loss.backward()
            return loss

        key = "shorter_than_sp" + ("_break" if graph_break else "")
        out[key] = attempt(step)
        ref_loss, _ = reference(short, reference(_ids(2, 16))[1])
        ref_loss.backward()
        out[f"{key}_reference"] = float(ref_loss)
        out[f"{key}_grad"] = _grad_error(model, reference)
        out[f"{key}_reports"] = [(r.seq_len, r.notes) for r in compiled.autosp_reports[prefill:]]

    # A call under a TorchDispatchMode (FlopCounterMode): Dynamo would run it in eager and skip the
    # forward's code from then on. Refused before Dynamo sees it, the next call compiles as usual.
    from torch.utils.flop_counter import FlopCounterMode

    counted = autosp.compile(_llama(), backend="eager")
    with FlopCounterMode(display=False):
        out["under_mode"] = attempt(lambda: counted(_ids(2, 32), _ids(2, 32)))
    out["after_mode"] = attempt(lambda: counted(_ids(2, 32), _ids(2, 32)))

    # A length marked dynamic that AutoSP's lowering fixes (a fused qkv projection with a bias):
    # an AutoSPError that says what to do, not Dynamo's ConstraintViolationError.
    torch._dynamo.reset()
    biased = _FusedQKV()
    ids = _ids(2, 32)
    torch._dynamo.mark_dynamic(ids, 1)
    out["dynamic_fixed"] = attempt(lambda: autosp.compile(biased, backend="aot_eager")(ids))

    # Equal at the first call, apart later. Every rank stepping its optimizer alike keeps running.
    model = _llama()
    stepped = autosp.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out["stepped_alike"] = []
    for _ in range(2):
        result = attempt(lambda: stepped(_ids(2, 32), _ids(2, 32)))
        out["stepped_alike"].append(result)
        opt.zero_grad()
        if result["error"] is None:
            stepped(_ids(2, 32), _ids(2, 32)).backward()
            opt.step()
    weight = model.blocks[0].q.weight
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.add_(1e-3 * rank)  # rank 1 alone (a checkpoint loaded there only)
    out["stepped_apart"] = attempt(lambda: stepped(_ids(2, 32), _ids(2, 32)))
    with torch.no_grad():
        weight.copy_(saved)  # its version moved on; its values agree again
    out["agree_again"] = attempt(lambda: stepped(_ids(2, 32), _ids(2, 32)))
    # A hand-written SGD step through .data on rank 1 alone: no version counter moves.
    if rank == 1:
        for p in model.parameters():
            p.data -= 0.1 * p.data.sign()
    out["data_written_apart"] = attempt(lambda: stepped(_ids(2, 32), _ids(2, 32)))

    # Ranks seeded apart (seed + rank) with dropout in the program: a mask on the pooled vector
    # would differ between the ranks. Without dropout the same seeding is fine.
    for p in (0.1, 0.0):
        torch.manual_seed(0)
        pooled = _PooledClassifier(p)
        torch.manual_seed(1000 + rank)
        out[f"rng_differs_p{p}"] = attempt(
            lambda: autosp.compile(pooled, backend="eager")(_ids(2, 32), _ids(2, 1)[:, 0] % 4)
        )
    # The same with Python's random module, whose draws Dynamo makes graph inputs.
    for seeded, seed in (("apart", 1000 + rank), ("alike", 5)):
        random.seed(seed)
        out[f"python_rng_{seeded}"] = attempt(
            lambda: autosp.compile(_PythonRandomScale(), backend="eager")(_ids(2, 32))
        )
    random.seed(5)
    out["python_rng_eager"] = float(_PythonRandomScale()(_ids(2, 32)))
    # Drawn in code that runs in eager (no graph shows it): refused after the call, on every rank alike.
    for draw in ("numpy", "torch"):
        for seeded, seed in (("apart", 1000 + rank), ("alike", 5)):
            masked = autosp.compile(_MaskedInEager(draw), backend="eager")  # built from seed 0
            _seed_draw(draw, seed)
            out[f"eager_{draw}_rng_{seeded}"] = attempt(lambda masked=masked: masked(_ids(2, 32)))
        masked = _MaskedInEager(draw)
        _seed_draw(draw, 5)
        out[f"eager_{draw}_rng_eager"] = float(masked(_ids(2, 32)))
    # Seeded alike, the SP program's dropout masks are the single-device program's: loss and gradients.
    torch.manual_seed(0)
    sp_model = _PooledClassifier(0.5)
    reference = copy.deepcopy(sp_model)
    y = _ids(2, 1)[:, 0] % 4
    torch.manual_seed(7)
    sp_loss = autosp.compile(sp_model, backend="eager")(_ids(2, 32), y)
    sp_loss.backward()
    torch.manual_seed(7)
    ref_loss = reference(_ids(2, 32), y)
    ref_loss.backward()
    out["rng_alike_vs_eager"] = {
        "loss": (float(sp_loss), float(ref_loss)),
        "grad": max(
            (a.grad - b.grad).abs().max().item() for a, b in zip(sp_model.parameters(), reference.parameters())
        ),
    }
    torch.manual_seed(0)

    # A graph that compiles on rank 0 and fails to compile on rank 1 (its backward, then its
    # forward): rank 0 must not run it and wait in a collective rank 1 never joins.
    from autosp.passes.manager import PassManager, Stage

    run_passes = PassManager.run
    for stage in (Stage.BACKWARD, Stage.FORWARD):

        def fails_on_rank_1(self: Any, at: Stage, gm: Any, ctx: Any, stage: Stage = stage) -> Any:
            if at is stage and rank == 1:
                raise RuntimeError(f"injected: the {stage.value} graph does not compile on rank 1")
            return run_passes(self, at, gm, ctx)

        PassManager.run = fails_on_rank_1
        try:
            compiled = autosp.compile(_llama(), backend="eager")
            out[f"compile_fails_{stage.value}"] = attempt(lambda: compiled(_ids(2, 32), _ids(2, 32)).backward())
        finally:
            PassManager.run = run_passes
    out["after_compile_failure"] = attempt(lambda: compiled(_ids(2, 32), _ids(2, 32)))

    # Ranks whose programs differ where no input shows it: a module attribute steering the program
    # (once a silently wrong loss), or a settings object passed in (once compared by type only).
    steered = _Steered(scale=1.0 + rank)
    out["program_differs"] = attempt(lambda: autosp.compile(steered, backend="eager")(_ids(2, 32)))
    settings = types.SimpleNamespace(scale=1.0 + rank)
    out["settings_differ"] = attempt(lambda: autosp.compile(_Steered(1.0), backend="eager")(_ids(2, 32), settings))
    # The attribute changed on one rank after a first call: Dynamo recompiles there only, while the
    # other rank runs the first graph (once: that rank waited in a collective until the timeout).
    changing = _Steered(1.0)
    compiled = autosp.compile(changing, backend="eager")
    out["changed_first"] = attempt(lambda: compiled(_ids(2, 32)))
    changing.scale = 1.0 + rank
    out["changed_later"] = attempt(lambda: compiled(_ids(2, 32)))
    # A forward hook registered after the first call: Dynamo, not guarding module hooks by default,
    # kept the first graph and skipped the hook, on every rank (and on the ranks that had it).
    hooked = _Steered(1.0)
    reference = copy.deepcopy(hooked)
    compiled = autosp.compile(hooked, backend="eager")
    out["hook_first"] = attempt(lambda: compiled(_ids(2, 32)))
    for m in (hooked, reference):
        m.qkv.register_forward_hook(lambda mod, args, y: y * 2)
    out["hook_everywhere"] = attempt(lambda: compiled(_ids(2, 32)))
    out["hook_reference"] = float(reference(_ids(2, 32)))
    if rank == 1:
        hooked.head.register_forward_hook(lambda mod, args, y: y + 1)
    out["hook_one_rank"] = attempt(lambda: compiled(_ids(2, 32)))
    # A hook that only records, on rank 0 only: Dynamo recompiles there into the same program, whose
    # agreement met rank 1's run (once: rank 0 then waited in a second exchange until the timeout).
    recorded: list[Any] = []
    logged = _Steered(1.0)
    compiled = autosp.compile(logged, backend="eager")
    out["record_first"] = attempt(lambda: compiled(_ids(2, 32)))
    if rank == 0:
        logged.qkv.register_forward_hook(lambda mod, args, y: recorded.append(tuple(y.shape)))
    out["record_one_rank"] = [attempt(lambda: compiled(_ids(2, 32))) for _ in range(2)]
    out["recorded"] = recorded
    # Tensors the forward reads that are neither parameters, buffers nor inputs: a plain attribute
    # and a global. Apart on the ranks (before the first call, or filled on one rank after it), each
    # rank once ran with its own, silently.
    out["attribute_apart"] = attempt(lambda: autosp.compile(_Attribute(1.0 + rank), backend="eager")(_ids(2, 32)))
    alike = _Attribute(1.0)
    reference = copy.deepcopy(alike)
    compiled = autosp.compile(alike, backend="eager")
    out["attribute_alike"] = attempt(lambda: compiled(_ids(2, 32)))
    out["attribute_reference"] = float(reference(_ids(2, 32)))
    alike.table.fill_(1.0 + rank)
    out["attribute_filled"] = attempt(lambda: compiled(_ids(2, 32)))
    alike.table.fill_(1.0)
    GLOBAL_SCALE.fill_(1.0 + rank)
    out["global_filled"] = attempt(lambda: compiled(_ids(2, 32)))
    GLOBAL_SCALE.fill_(1.0)
    out["attribute_agree_again"] = attempt(lambda: compiled(_ids(2, 32)))
    across = _EmptyAcrossBreak(1.0)
    out["empty_across_break"] = attempt(lambda: autosp.compile(across, backend="eager")(_ids(2, 32)))
    out["empty_across_break_reference"] = float(copy.deepcopy(across)(_ids(2, 32)))
    # Called under no_grad on one rank only: Dynamo would compile another graph there (once a hang).
    same = autosp.compile(_Steered(1.0), backend="eager")
    with torch.no_grad() if rank == 1 else contextlib.nullcontext():
        out["grad_mode_differs"] = attempt(lambda: same(_ids(2, 32)))
    with torch.inference_mode() if rank == 1 else torch.no_grad():  # other graphs too (once a wait to the timeout)
        out["inference_mode_differs"] = attempt(lambda: same(_ids(2, 32)))
    # outputs="sharded" with a graph break after an output: a clear error (once Dynamo's own, on a DTensor).
    broken = autosp.compile(_Steered(1.0, graph_break=True), backend="eager", outputs="sharded")
    out["sharded_across_break"] = attempt(lambda: broken(_ids(2, 32)))

    # autosp.backend used directly: the check runs inside the compiled graph.
    direct = torch.compile(_llama(), backend=autosp.backend(backend="eager"))
    ids = _ids(2, 64) if rank == 0 else _ids(1, 128)
    out["backend_shapes"] = attempt(lambda: direct(ids, ids))
    return out


def rank_raises(rank: int, world: int, timeout: float) -> dict[str, Any]:
    """Rank 1 raises in its own code and stays alive; rank 0 must fail within ``timeout``.

    Rank 1 then waits in a barrier of the world group (its own, longer timeout) until rank 0
    has failed, so both move on to the next case together.
    """
    from autosp.options import group_timeout

    # Groups AutoSP makes: timeout= when given, else the world's (harness: 120 s), not gloo's 30 min.
    out: dict[str, Any] = {
        "group_timeouts": [
            group_timeout(autosp.backend(sp_size=1).group).total_seconds(),
            group_timeout(autosp.backend(sp_size=2, timeout=timeout).group).total_seconds(),
        ]
    }
    ids = _ids(2, 32)

    def case(name: str, check_inputs: str, before_backward: bool) -> None:
        compiled = autosp.compile(_llama(), backend="eager", timeout=timeout, check_inputs=check_inputs)
        compiled(ids, ids).backward()  # one good step (rank 1 compiles slower: see below)
        loss = compiled(ids, ids) if before_backward else None
        if rank == 1:
            try:
                raise ValueError("a user-side error on rank 1 (data, logging, ...)")
            except ValueError:
                pass  # caught by the user's loop, which goes on to a barrier of its own
        else:
            out[name] = attempt(loss.backward if before_backward else lambda: compiled(ids, ids).backward())
        dist.barrier()

    # Compile time is not collective time: rank 1's backward compiles 2.5 timeouts slower, and the
    # first step still runs (the backward compiles with the forward, then the ranks wait for each
    # other on the world's timeout).
    from autosp.passes.manager import PassManager, Stage

    run_passes = PassManager.run

    def slow_backward(self: Any, stage: Stage, gm: Any, ctx: Any) -> Any:
        if stage is Stage.BACKWARD and rank == 1:
            time.sleep(2.5 * timeout)
        return run_passes(self, stage, gm, ctx)

    PassManager.run = slow_backward
    try:
        case("check", "shapes", before_backward=False)
    finally:
        PassManager.run = run_passes
    case("program", "off", before_backward=False)
    case("backward", "shapes", before_backward=True)
    return out


class _Logits(torch.nn.Module):
    """Embedding, one causal SDPA layer, an LM head: returns logits, the loss computed by the caller."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.qkv, self.head = torch.nn.Embedding(96, 16), torch.nn.Linear(16, 48), torch.nn.Linear(16, 96)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        q, k, v = self.qkv(x).view(*ids.shape, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return self.head(
            x + torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        )


def gradients_apart(rank: int, world: int) -> dict[str, Any]:
    """Ranks backpropagating different gradients into the same outputs: a loss scaled per rank (a
    micro-batch count of its own), and a loss computed outside the program from per-rank labels.
    Both once gave every rank the gradients of another loss, silently."""
    ids = _ids(2, 32)
    out: dict[str, Any] = {}
    compiled = autosp.compile(_llama(), backend="eager")
    out["scaled"] = attempt(lambda: (compiled(ids, ids) / (1 + rank)).backward())

    def scaled_by_hook() -> None:  # the same scale, as a hook on the output (once unseen by the check)
        loss = compiled(ids, ids)
        loss.register_hook(lambda g: g / (1 + rank))
        loss.backward()

    out["scaled_by_hook"] = attempt(scaled_by_hook)
    model, reference = _Logits(), _Logits()
    logits_of = autosp.compile(model, backend="eager")
    ce = torch.nn.functional.cross_entropy
    out["labels_apart"] = attempt(
        lambda: ce(logits_of(ids).flatten(0, 1), _ids(2, 32, seed=1 + rank).flatten()).backward()
    )
    model.zero_grad()
    # The same labels on every rank: the single-device gradients.
    labels = _ids(2, 32, seed=1)
    out["labels_alike"] = attempt(lambda: ce(logits_of(ids).flatten(0, 1), labels.flatten()).backward())
    ce(reference(ids).flatten(0, 1), labels.flatten()).backward()
    out["labels_alike_grad"] = max(
        float((a.grad - b.grad).abs().max()) for a, b in zip(model.parameters(), reference.parameters())
    )
    return out


def steps_apart(rank: int, world: int) -> dict[str, Any]:
    """Ranks whose steps part: an extra forward on rank 0 (an evaluation there only), then a
    backward skipped on rank 1. Each once paired one rank's collectives with another's and waited
    until the group's timeout (or, the forward's exchanges alike, ran and hung in the next step)."""
    ids = _ids(2, 32)
    out: dict[str, Any] = {}
    compiled = autosp.compile(_llama(), backend="eager")
    out["first"] = attempt(lambda: compiled(ids, ids).backward())
    out["first_loss"] = float(_llama()(ids, ids))  # the single-device loss of a fresh model
    if rank == 0:
        out["extra"] = attempt(lambda: compiled(ids, ids))  # grad mode on, the training batch: nothing differs
    # Rank 0 calls the forward while rank 1 is in the backward of the same step.
    out["extra_next"] = attempt(lambda: compiled(ids, ids).backward())

    compiled = autosp.compile(_llama(), backend="eager")
    loss = compiled(ids, ids)
    if rank == 0:
        out["skip"] = attempt(loss.backward)
    else:
        out["skip"] = attempt(lambda: compiled(ids, ids))  # no backward: straight to the next forward

    # In step again: a full step on every rank runs.
    def step() -> torch.Tensor:
        loss = compiled(ids, ids)
        loss.backward()
        return loss

    out["after"] = attempt(step)
    return out


def groups_after_destroy(rank: int, world: int) -> dict[str, Any]:
    """Compiled programs on subgroups (hybrid's, sp_size < world, a user's), then destroy_process_group.

    AutoSP holds groups weakly: none of the groups it made or was given may outlive the
    destruction (torch keeps the default group's own object alive itself), and calling a
    program compiled on a destroyed group is a clear error, not a crash inside a collective.
    """
    import gc
    import weakref

    ids = _ids(2, 64)
    user_group = dist.new_group()
    programs = {
        "hybrid": autosp.compile(_llama(), backend="eager", variant="hybrid"),
        "dp_x_sp": autosp.compile(_llama(), backend="eager", sp_size=2),
        "user_group": autosp.compile(_llama(), backend="eager", group=user_group),
    }
    for compiled in programs.values():
        compiled(ids, ids).backward()
    world_group = dist.group.WORLD
    made = [weakref.ref(g) for g in dist.distributed_c10d._world.pg_map if g is not world_group]
    del user_group, world_group
    dist.destroy_process_group()
    gc.collect()
    out: dict[str, Any] = {"groups": len(made), "alive": sum(r() is not None for r in made)}
    for name, compiled in programs.items():
        out[name] = attempt(lambda compiled=compiled: compiled(ids, ids))
    return out


_FAIL_AT_THE_END = {"now": False}


@torch.compiler.disable
def _maybe_fail() -> None:
    if _FAIL_AT_THE_END["now"]:
        raise ValueError("a rank-local error after the program's last collective")


class _FailsAtTheEnd(_Steered):
    """``_Steered``, then (a graph break) an error on the ranks told to raise one."""

    def __init__(self) -> None:
        super().__init__(1.0)

    def forward(self, ids: torch.Tensor, settings: Any = None) -> torch.Tensor:
        y = super().forward(ids, settings)
        _maybe_fail()
        return y


def peer_fails_in_program(rank: int, world: int, variant: str) -> dict[str, Any]:
    """A token id outside the embedding's range, in rank 1's tokens only: rank 1's program raises
    and rank 1 stays alive; rank 0 must learn it at once (``autosp.PeerFailed``), not at the group's
    timeout (the harness's world: 120 s). First such an id in every rank's tokens: all raise at the
    same point and go on, and a step where rank 0 comes late (rank 1 polls, reading rank 0's note
    of that error) runs as usual."""
    compiled = autosp.compile(_llama(), backend="eager", variant=variant)
    ids = _ids(2, 32)
    half = 32 // world
    out: dict[str, Any] = {"good": attempt(lambda: compiled(ids, ids))}
    everywhere = ids.clone()
    everywhere[0, 3] = everywhere[0, half + 3] = 96 + 5
    out["everywhere"] = attempt(lambda: compiled(everywhere, ids))
    if rank == 0:
        time.sleep(1.0)
    out["after"] = attempt(lambda: compiled(ids, ids))
    # Rank 1 raises after the program's last collective, catches it and comes back (1 s late, then
    # 3 s): rank 0 was never stuck, and its waits for rank 1 end as rank 1 comes, not in an error.
    evaluated = autosp.compile(_FailsAtTheEnd(), backend="eager", variant=variant)
    with torch.no_grad():
        out["eval"] = [attempt(lambda: evaluated(ids))]
        _FAIL_AT_THE_END["now"] = rank == 1
        out["eval"].append(attempt(lambda: evaluated(ids)))
        _FAIL_AT_THE_END["now"] = False
        for late in (1.0, 3.0):
            if rank == 1:
                time.sleep(late)
            out["eval"].append(attempt(lambda: evaluated(ids)))
    one = ids.clone()
    one[1, half + 5] = 96 + 5
    out["one"] = attempt(lambda: compiled(one, ids))
    # Rank 1 stays alive (a caught error, a checkpoint being saved) until rank 0 has its error.
    _stay_until_all_failed("peer_fails_in_program", world)
    return out


_FAIL_IN_BACKWARD = {"now": False}


@torch.library.custom_op("autosp_guards::passes", mutates_args=())
def _passes(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@torch.library.custom_op("autosp_guards::takes_gradient", mutates_args=())
def _takes_gradient(grad: torch.Tensor) -> torch.Tensor:
    # At run time, in the compiled backward, on the ranks told to: a rank-local error there.
    if _FAIL_IN_BACKWARD["now"]:
        raise ValueError("a rank-local error in the backward")
    return grad.clone()


@_passes.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@_takes_gradient.register_fake
def _(grad: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(grad)


_passes.register_autograd(lambda ctx, grad: torch.ops.autosp_guards.takes_gradient(grad))


class _FailsInBackward(_Steered):
    """``_Steered`` with an op after its attention whose backward raises on the ranks told to: the
    others wait in attention's backward all-to-all, which comes after it."""

    def __init__(self) -> None:
        super().__init__(1.0)

    def forward(self, ids: torch.Tensor, settings: Any = None) -> torch.Tensor:
        x = self.embed(ids)
        q, k, v = self.qkv(x).view(*ids.shape, 3, 2, 8).permute(2, 0, 3, 1, 4)
        x = x + torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        return self.head(torch.ops.autosp_guards.passes(x)).square().mean()


def peer_fails_in_backward(rank: int, world: int, backend: str, leaves: bool) -> dict[str, Any]:
    """Rank 1's compiled backward raises: rank 0, in the backward's next collective, must learn it
    at once, not at the group's timeout: ``autosp.PeerFailed`` while rank 1 stays alive, or a
    ``CollectiveFailure`` naming rank 1's error when rank 1 leaves the group."""
    compiled = autosp.compile(_FailsInBackward(), backend=backend)
    ids = _ids(2, 32)
    out = {"good": attempt(lambda: _backward(compiled(ids)))}
    _FAIL_IN_BACKWARD["now"] = rank == 1
    out["bad"] = attempt(lambda: _backward(compiled(ids)))
    if leaves and rank == 1:
        dist.destroy_process_group()
    elif not leaves:
        _stay_until_all_failed(f"peer_fails_in_backward_{backend}", world)
    return out


def _backward(loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    return loss


def peer_fails_in_hybrid(rank: int, world: int) -> dict[str, Any]:
    """4 ranks under hybrid (2 x 2): rank 3's tokens hold an id outside the embedding's range.
    Rank 0 shares no subgroup with rank 3: it waits on ranks 1 and 2, which pass the cause on."""
    compiled = autosp.compile(_llama(), backend="eager", variant="hybrid")
    ids = _ids(2, 32)
    out = {"good": attempt(lambda: compiled(ids, ids))}
    bad = ids.clone()
    bad[1, 3 * (32 // world) + 3] = 96 + 5
    out["bad"] = attempt(lambda: compiled(bad, ids))
    _stay_until_all_failed("peer_fails_in_hybrid", world)
    return out


def _stay_until_all_failed(key: str, world: int) -> None:
    """Every rank stays alive until all have their error (through the store: the group is broken);
    a failed rank that left would close its connections, and its peers fail on that instead."""
    store = dist.distributed_c10d._get_default_store()
    store.add(key, 1)
    while int(store.add(key, 0)) < world:
        time.sleep(0.05)


def failed_rank_leaves(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 announces an error of its program and leaves the group at once: rank 0's next
    collective fails on the closed connection, and its message names rank 1's error."""
    from autosp.guards import naming_comm_failures

    group, x = dist.group.WORLD, torch.ones(3)
    peer_failure.wait(dist.all_reduce(x, async_op=True), group, x.device)
    if rank == 1:
        peer_failure.announce(IndexError("index out of range in self"))
        dist.destroy_process_group()
        return {}

    def collective() -> None:
        with naming_comm_failures("a collective of the SP program", group):
            peer_failure.wait(dist.all_reduce(x, async_op=True), group, x.device)

    time.sleep(0.5)
    return {"after": attempt(collective)}


def calls_alone(rank: int, world: int, timeout: float, warn_after: float) -> dict[str, Any]:
    """Rank 0 calls the compiled model once more on its own (evaluation on rank 0 only), rank 1 is busy."""

    peer_failure.WAIT_WARN_S = warn_after
    compiled = autosp.compile(_llama(), backend="eager", timeout=timeout)
    compiled(_ids(2, 32), _ids(2, 32))  # both ranks: one call each, in step
    out: dict[str, Any] = {}
    if rank == 0:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with torch.no_grad():
                out["alone"] = attempt(lambda: compiled(_ids(2, 32), _ids(2, 32)))
        out["late"] = [str(w.message) for w in seen if issubclass(w.category, peer_failure.PeersLate)]
    else:
        time.sleep(timeout + 3)  # busy elsewhere until rank 0 has given up
    return out
