"""autosp-sac-bench: what sequence-aware activation checkpointing saves, and what it costs.

For a Llama-style model (GQA, several layers), at each sequence length and sp_size,
rank 0 measures the bytes saved for backward by one compiled forward (parameters
excluded; ``saved_tensors_hooks``) with SAC off, auto and on, next to the floor
when attention is never recomputed (each layer's input, attention output and
log-sum-exp, plus the final hidden state), and the median step time; DeepSpeed's
AutoSP runs the same model and tokens beside them. The FLOPs and bytes SAC
recomputes come from the compiled graphs (``autosp_sac.audit``). Prints a markdown
table and writes ``results.json``, ``sac.md`` and ``sac.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from autosp.testing import SavedBytes
from autosp_tools.launch import launch
from autosp_tools.model import LlamaLM, ModelConfig

SACS: tuple[Any, ...] = (False, "auto", True)
DEEPSPEED = "deepspeed"  # in place of a SAC setting: DeepSpeed's AutoSP on the same case


@dataclass(frozen=True)
class Case:
    seq: int
    sp: int
    sac: Any
    model: ModelConfig
    steps: int
    backend: str

    @property
    def nproc(self) -> int:
        return self.sp


def floor_bytes(case: Case) -> int:
    """Per rank: layer inputs, attention outputs and lse per layer, plus the final hidden state (fp32)."""
    c, s, p = case.model, case.seq, case.sp
    hd = c.dim // c.heads
    per_layer = s // p * c.dim + c.heads // p * s * hd + c.heads // p * s
    return 4 * (c.layers * per_layer + s // p * c.dim)


def _steps(step: Callable[[], torch.Tensor], model: torch.nn.Module, steps: int) -> dict[str, Any]:
    """The compile step, then ``steps`` timed steps; the first of them records the bytes saved for backward."""
    start = time.perf_counter()
    step()
    compile_s = time.perf_counter() - start
    saved = SavedBytes(model.parameters(), distinct=False)
    times = []
    for i in range(steps):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        if i == 0:
            with saved.record():
                loss = step()
        else:
            loss = step()
        times.append(time.perf_counter() - start)
    return {"saved_bytes": saved.total, "step_s": statistics.median(times), "compile_s": compile_s, "loss": float(loss)}


def _inputs(case: Case) -> torch.Tensor:
    return torch.randint(0, case.model.vocab, (1, case.seq), generator=torch.Generator().manual_seed(1))


def measure(case: Case, rank: int, world: int) -> dict[str, Any]:
    import autosp

    torch._dynamo.reset()  # one-rank cases run in this process; stay under Dynamo's recompile limit
    torch.manual_seed(0)
    model = LlamaLM(case.model)
    opts: dict[str, Any] = {"sp_size": world} if world > 1 else {}
    # SAC's own effect: tiled MLPs (on with sac=True by default) hide their matmuls from the audit.
    compiled = autosp.compile(model, sac=case.sac, backend=case.backend, tile_mlp=False, **opts)
    ids = _inputs(case)

    def step() -> torch.Tensor:
        loss = compiled(ids, ids)
        loss.backward()
        return loss.detach()

    result = _steps(step, model, case.steps)
    report = compiled.autosp_reports[0]
    return {**result, "sac_report": {k: str(v) for k, v in report.sac.items()}}


def measure_deepspeed(case: Case, rank: int, world: int) -> dict[str, Any]:
    """DeepSpeed's AutoSP on the same model and tokens (always Inductor; ZeRO 0)."""
    from autosp_tools.bench.ds_autosp import DeepSpeedAutoSP

    torch.manual_seed(0)
    ds = DeepSpeedAutoSP(LlamaLM(case.model), batch_size=1)
    ids = _inputs(case)
    reported: list[float] = []

    def step() -> torch.Tensor:
        loss, mean = ds.forward(ids, ids)
        ds.backward(loss)
        reported.append(mean)
        return loss.detach()

    result = _steps(step, ds.model, case.steps)
    # Its rank-local losses averaged, as its users would report them (wrong with in-model shifted labels).
    return {**result, "loss": reported[-1]}


def run_case(case: Case) -> dict[str, Any]:
    try:
        if case.sac == DEEPSPEED:
            result = launch(measure_deepspeed, case, always_spawn=True)
        else:
            result = launch(measure, case)
    except Exception as e:  # noqa: BLE001 - a failed case is a result, not the end of the run
        result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    return {"seq": case.seq, "sp": case.sp, "sac": str(case.sac), "floor_bytes": floor_bytes(case), **result}


def _fraction(run: dict[str, Any], key: str) -> str:
    value = run.get("sac_report", {}).get(key)
    return f"{float(value):.1%}" if value is not None else "-"


def table(rows: list[dict[str, Any]]) -> str:
    by_key: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_key.setdefault((r["sp"], r["seq"]), {})[r["sac"]] = r
    lines = [
        "| sp | seq | floor MiB | saved off | saved auto | saved on | saved DeepSpeed | on / floor | auto mode "
        "| step ms off | step ms auto | step ms on | step ms DeepSpeed | on / off | DeepSpeed / on "
        "| DeepSpeed / auto | recomputed FLOPs | recomputed comm |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    mib = 2**20
    for (sp, seq), runs in sorted(by_key.items()):
        off, auto, on, ds = (runs.get(k, {}) for k in ("False", "auto", "True", DEEPSPEED))
        floor = (off or on or auto or ds).get("floor_bytes", 0)

        def saved(r: dict[str, Any]) -> str:
            return f"{r['saved_bytes'] / mib:.2f}" if "saved_bytes" in r else r.get("error", "-")[:40]

        def ms(r: dict[str, Any]) -> str:
            return f"{r['step_s'] * 1e3:.0f}" if "step_s" in r else "-"

        def ratio(a: dict[str, Any], b: dict[str, Any]) -> str:
            return f"{a['step_s'] / b['step_s']:.2f}" if "step_s" in a and "step_s" in b else "-"

        on_floor = f"{on['saved_bytes'] / floor:.2f}" if "saved_bytes" in on and floor else "-"
        mode = auto.get("sac_report", {}).get("mode", "-").split("-> ")[-1]
        lines.append(
            f"| {sp} | {seq} | {floor / mib:.2f} | {saved(off)} | {saved(auto)} | {saved(on)} | {saved(ds)} "
            f"| {on_floor} | {mode} | {ms(off)} | {ms(auto)} | {ms(on)} | {ms(ds)} | {ratio(on, off)} "
            f"| {ratio(ds, on)} | {ratio(ds, auto)} "
            f"| {_fraction(on, 'recomputed FLOP fraction')} | {_fraction(on, 'recomputed comm fraction')} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for sp in sorted({r["sp"] for r in rows}):
        for sac, style in (("False", "-"), ("auto", ":"), ("True", "--"), (DEEPSPEED, "-.")):
            pts = sorted(
                (r["seq"], r["saved_bytes"] / 2**20)
                for r in rows
                if r["sp"] == sp and r["sac"] == sac and "saved_bytes" in r
            )
            if pts:
                ax.plot(*zip(*pts), style, marker="o", label=f"sp={sp} sac={sac}")
        floor = sorted({(r["seq"], r["floor_bytes"] / 2**20) for r in rows if r["sp"] == sp})
        ax.plot(*zip(*floor), color="grey", alpha=0.4, label=f"sp={sp} floor")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="sequence length",
        ylabel="MiB saved for backward per rank",
        title="Saved for backward: AutoSP SAC off / auto / on, DeepSpeed AutoSP",
    )
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="autosp-sac-bench", description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="2048,4096,8192,16384", help="comma-separated sequence lengths")
    p.add_argument("--sp", default="1,2,4", help="comma-separated sp sizes")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps after the compile step")
    p.add_argument(
        "--backend",
        default="inductor",
        choices=("aot_eager", "inductor"),
        help="compiler after AutoSP; DeepSpeed's AutoSP always uses Inductor",
    )
    p.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed's AutoSP")
    p.add_argument("--quick", action="store_true", help="lengths 1024,2048 and sp 1,2")
    p.add_argument("--out", default="runs/sac-bench")
    return p.parse_args(argv)


def run(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark; returns one row per (sp, length, sac)."""
    args = parse(argv)
    if args.quick:
        args.lengths, args.sp = "1024,2048", "1,2"
    cfg = ModelConfig(
        vocab=256,
        dim=args.dim,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        hidden=args.dim * 2,
        max_len=1 << 20,
        impl="builtin",
    )
    settings = SACS if args.no_deepspeed else (*SACS, DEEPSPEED)
    cases = [
        Case(int(s), int(p), sac, cfg, args.steps, args.backend)
        for p in args.sp.split(",")
        for s in args.lengths.split(",")
        for sac in settings
    ]
    from tqdm import tqdm

    rows = []
    for case in tqdm(cases, desc="sac-bench", unit="run"):
        rows.append(run_case(case))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"model": asdict(cfg), "rows": rows}, indent=1))
    md = table(rows)
    (out / "sac.md").write_text(md + "\n")
    plot(rows, out / "sac.png")
    print(md)
    print(f"wrote {out / 'results.json'}, {out / 'sac.md'}, {out / 'sac.png'}")
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    run(argv)


if __name__ == "__main__":
    main()
