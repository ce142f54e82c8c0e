"""The checks that need a GPU, as one run that writes one JSON (``tools/gpu_check.sh``).

Stages, each in its own try/except so one failure keeps the others' results:

* ``env``: torch, CUDA, the device and its memory.
* ``equivalence``: ``autosp.verify`` (the SP program against single-device eager, values and
  every gradient) with 2 processes sharing the GPU over gloo, per variant and backend.
* ``flex``: FlexAttention (a per-head ``score_mod``, a packed-documents block mask) under Ulysses
  and ring, values and every gradient (the CPU has no Flex backward: forward only there).
* ``sac_kernels``: with each CUDA SDPA kernel forced (flash, efficient, cuDNN), SAC on must save
  the attention outputs and never run an attention forward in the backward.
* ``plan_vs_measured``: ``autosp-plan``'s saved bytes and peak against ``torch.cuda.max_memory_allocated``
  at sp=1, and for rank 0 of sp=8 run for real under a fake group of 8.
* ``step_time``: bf16 step time of AutoSP (SAC off/on) against compiled hand-written Ulysses.
* ``overlap_trace``: ``tools/scripts/overlap_trace.py --device cuda``: the exchanges in flight
  while CUDA kernels run, with and without the overlap passes, and gzipped Chrome traces.

``--device cpu --quick`` runs the same code on the CPU with small sizes (a test keeps it working).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import pkgutil
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from autosp_tools.model import ModelConfig
from autosp_tools.plan.measure import SHIPPED, TINY, Case, measure, measure_fake_world, predict

SDPA_KERNELS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")


class Check:
    """Collects stage results into one JSON, written after every stage (a crash keeps what ran)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.data: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "stages": {}}

    def stage(self, name: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        print(f"[gpu_check] {name} ...", flush=True)
        try:
            value = fn()
            # A stage that ran but had failing points says so in "failed", and keeps its results.
            failed = value.get("failed") if isinstance(value, dict) else None
            result = {"ok": not failed, "result": value}
            if failed:
                result["error"] = f"failed: {failed}"
        except KeyboardInterrupt:  # gpu_check.sh's timeout: record where it stopped, then stop
            self.data["stages"][name] = {
                "ok": False,
                "error": "interrupted (time limit)",
                "seconds": round(time.perf_counter() - start, 2),
            }
            self.write()
            raise
        except Exception as e:  # noqa: BLE001 - every stage's failure is recorded, the run goes on
            result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        result["seconds"] = round(time.perf_counter() - start, 2)
        self.data["stages"][name] = result
        self.write()
        print(
            f"[gpu_check] {name}: {'ok' if result['ok'] else result['error'][:300]} ({result['seconds']} s)", flush=True
        )
        return result

    def write(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.data, indent=2, default=str))


PACKAGES = ("autosp", "autosp_ulysses", "autosp_sac", "autosp_ring", "autosp_tools")


def import_failures() -> dict[str, str]:
    """Every module of the packages that does not import (a torch release that renamed an internal)."""
    failures = {}
    for top in PACKAGES:
        try:
            pkg = importlib.import_module(top)
        except Exception as e:  # noqa: BLE001 - each failure is a result
            failures[top] = f"{type(e).__name__}: {e}"
            continue
        for mod in pkgutil.walk_packages(pkg.__path__, prefix=f"{top}."):
            if ".tests" in mod.name or mod.name.endswith("__main__"):
                continue
            try:
                importlib.import_module(mod.name)
            except Exception as e:  # noqa: BLE001
                failures[mod.name] = f"{type(e).__name__}: {e}"
    return failures


def env_info(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device,
        "cuda_available": torch.cuda.is_available(),
        "import_failures": import_failures(),
    }
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device: run on a GPU machine, or pass --device cpu --quick to check the script")
        props = torch.cuda.get_device_properties(0)
        info.update(
            name=props.name,
            memory_bytes=props.total_memory,
            capability=f"{props.major}.{props.minor}",
            cuda=torch.version.cuda,
            devices=torch.cuda.device_count(),
        )
    return info


def _verify_rank(cfg: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """One rank of ``autosp.verify`` on the shared device (gloo carries CUDA tensors between the 2 processes)."""
    import autosp
    from autosp_tools.model import build_model
    from autosp_tools.plan.gpu_flex import fresh_rank

    device = fresh_rank(cfg["device"])
    model = build_model(cfg["model"]).to(device)
    ids = torch.randint(0, cfg["model"].vocab, (1, cfg["seq"]), generator=torch.Generator().manual_seed(2)).to(device)
    report = autosp.verify(
        model, ids, ids, sp_size=world, backend=cfg["backend"], variant=cfg["variant"], sac=cfg["sac"]
    )
    return {"passed": True, "report": str(report)[:2000]}


def _failure(e: BaseException) -> dict[str, str]:
    """One case's error with where it was raised: a lease rarely has time for a second run to find out."""
    return {"error": f"{type(e).__name__}: {str(e)[:1000]}", "traceback": traceback.format_exc()[-2500:]}


class _Cfg(dict):
    @property
    def nproc(self) -> int:
        return self["world"]


ALL_COMBOS = tuple(
    f"{v}/{b}/sac={s}" for v in ("ulysses", "ring") for b in ("aot_eager", "inductor") for s in (False, True)
)
# What fits a 15-minute device lease with the machine's start: each variant under aot_eager with
# SAC off and under Inductor with SAC on (about 30 s each on an H200).
DEFAULT_COMBOS = tuple(f"{v}/{b}" for v in ("ulysses", "ring") for b in ("aot_eager/sac=False", "inductor/sac=True"))


def _parse_combo(text: str) -> tuple[str, str, bool]:
    parts = text.split("/")
    if len(parts) != 3 or parts[2] not in ("sac=True", "sac=False"):
        raise ValueError(f"--combos entry {text!r}: expected variant/backend/sac=True|False")
    return parts[0], parts[1], parts[2] == "sac=True"


def equivalence(
    device: str, quick: bool, combos: tuple[tuple[str, str, bool], ...] = tuple(map(_parse_combo, DEFAULT_COMBOS))
) -> dict[str, Any]:
    model = TINY if quick else replace(SHIPPED, vocab=512)
    if quick:
        combos = (("ulysses", "aot_eager", False),)
    cases = {
        f"{variant}/{backend}/sac={sac}": _Cfg(
            device=device, model=model, seq=256 if quick else 1024, backend=backend, variant=variant, sac=sac, world=2
        )
        for variant, backend, sac in combos
    }
    return _launch_each(_verify_rank, cases, "verify")


def _launch_each(fn: Callable[..., dict[str, Any]], cases: dict[str, _Cfg], what: str) -> dict[str, Any]:
    """``fn`` on 2 ranks per case; every case runs, and any that did not pass fails the stage after."""
    from autosp_tools.launch import launch

    out: dict[str, Any] = {}
    for key, cfg in cases.items():
        try:
            out[key] = launch(fn, cfg)
        except Exception as e:  # noqa: BLE001 - one case failing is recorded, the others run
            out[key] = {"passed": False, **_failure(e)}
    failed = [k for k, v in out.items() if not v.get("passed")]
    if failed:
        raise RuntimeError(f"{what} failed for {failed}: {json.dumps(out, default=str)[:3000]}")
    return out


def flex(device: str, quick: bool) -> dict[str, Any]:
    """FlexAttention (score_mod, document block mask) under each variant: values and gradients on CUDA."""
    from autosp_tools.plan.gpu_flex import flex_rank

    backend = "inductor" if device == "cuda" else "aot_eager"
    cases = {
        f"{variant}/{backend}": _Cfg(
            device=device, seq=128 if quick else 1024, backend=backend, variant=variant, world=2
        )
        for variant in ("ulysses", "ring")
    }
    return _launch_each(flex_rank, cases, "flex")


def overlap_trace(device: str, quick: bool, out: Path) -> dict[str, Any]:
    """``tools/scripts/overlap_trace.py`` on the device: exchanges in flight while kernels run.

    Needs the checkout (the script is not packaged); rank 0's Chrome traces go gzipped beside ``out``.
    """
    import gzip
    import subprocess

    script = Path(__file__).resolve().parents[3] / "scripts" / "overlap_trace.py"
    if not script.exists():
        script = Path.cwd() / "tools" / "scripts" / "overlap_trace.py"
    traces = out.parent / "overlap_traces"
    small = ["--seq", "256", "--layers", "1", "--dim", "64", "--heads", "4", "--kv-heads", "2", "--steps", "1"]
    size = small if quick else ["--seq", "8192", "--layers", "4", "--steps", "3"]
    cmd = [sys.executable, str(script), "--device", device, "--backends", "aot_eager" if quick else "inductor"]
    done = subprocess.run([*cmd, *size, "--trace", str(traces)], capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if done.returncode:
        raise RuntimeError(f"overlap_trace.py exited {done.returncode}: {done.stderr[-2500:]}")
    for trace in traces.glob("*.json"):
        with trace.open("rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
            dst.write(src.read())
        trace.unlink()
    return {"lines": lines, "traces": sorted(p.name for p in traces.glob("*.gz"))}


def sac_kernels(device: str, quick: bool) -> dict[str, Any]:
    """Per SDPA kernel: saved bytes with SAC on and off, and attention forwards found in the backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import autosp
    from autosp_tools.bench.measure import SavedBytes
    from autosp_tools.plan.measure import shipped_model

    kernels = SDPA_KERNELS if device == "cuda" else ("FLASH_ATTENTION",)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    seq = 512 if quick else 4096
    out: dict[str, Any] = {}
    for kernel in kernels:
        row: dict[str, Any] = {}
        try:
            for sac in (False, True):
                torch._dynamo.reset()
                torch.manual_seed(0)
                before = torch.get_default_dtype()
                torch.set_default_dtype(dtype)
                config = TINY if quick else SHIPPED
                try:
                    model = shipped_model(config.layers, config).to(device)
                finally:
                    torch.set_default_dtype(before)
                ids = torch.randint(0, config.vocab, (1, seq)).to(device)
                compiled = autosp.compile(model, sac=sac, backend="inductor" if not quick else "aot_eager")
                with sdpa_kernel(getattr(SDPBackend, kernel)):
                    compiled(ids, ids).backward()
                    saved = SavedBytes(list(model.parameters()))
                    with saved.record():
                        loss = compiled(ids, ids)
                    loss.backward()
                report = compiled.autosp_reports[0] if compiled.autosp_reports else None
                row[f"sac={sac}"] = {
                    "saved_bytes": saved.total,
                    "sac_report": {k: str(v) for k, v in report.sac.items()} if report else {},
                }
            on = row["sac=True"]["sac_report"]
            row["attention forwards in backward"] = on.get("attention forwards in backward")
            row["ok"] = str(row["attention forwards in backward"]) == "0"
        except Exception as e:  # noqa: BLE001 - a kernel this GPU lacks is a result
            row.update(_failure(e))
        out[kernel] = row
    out["failed"] = [k for k, v in out.items() if not v.get("ok")]
    return out


def plan_vs_measured(device: str, quick: bool) -> dict[str, Any]:
    """Predicted saved bytes and peak against the measured ones: sp=1, and rank 0 of sp=8 under a fake group."""
    dtype = "bf16" if device == "cuda" else "fp32"
    model = replace(TINY, heads=8) if quick else SHIPPED  # 8 query heads: Ulysses at sp=8 pads none
    seqs = (1024,) if quick else (4096,)  # tokens per rank: longer ones did not fit the lease with the rest
    out: dict[str, Any] = {}
    # Quick: only sp=8 under a fake group (sp=1 runs the same measure() in one process).
    for sp in (8,) if quick else (1, 8):
        for seq in seqs:
            for sac in (False, True):
                # Inductor on the GPU (what users run); aot_eager on the CPU (compiling is cheaper there).
                case = Case(
                    model,
                    seq=seq * (sp if sp > 1 else 1),
                    sp=sp,
                    sac=sac,
                    device=device,
                    dtype=dtype,
                    backend="inductor" if device == "cuda" else "aot_eager",
                )
                key = f"sp={sp}/seq={case.seq}/sac={sac}"
                try:
                    p = predict(case)
                    m = measure(case, 0, 1) if sp == 1 else measure_fake_world(case)
                    out[key] = {
                        "predicted": p,
                        "measured": m,
                        "saved_ratio": p["saved_bytes"] / m["saved_bytes"] if m["saved_bytes"] else None,
                        "peak_ratio": p["peak_bytes"] / m["peak_bytes"] if m["peak_bytes"] else None,
                    }
                except Exception as e:  # noqa: BLE001
                    out[key] = _failure(e)
                if quick:
                    break
    out["failed"] = [k for k, v in out.items() if "error" in v]
    return out


def step_time(device: str, quick: bool) -> dict[str, Any]:
    """bf16 median step time of AutoSP (one rank of sp=2 under a fake group, SAC off/on, Inductor) and
    of compiled hand-written Ulysses' local computation on the same device."""
    dtype = "bf16" if device == "cuda" else "fp32"
    model = TINY if quick else SHIPPED
    seq = 512 if quick else 16384
    out: dict[str, Any] = {}
    for sac in (False, True):
        case = Case(
            model,
            seq=seq,
            sp=2,
            sac=sac,
            device=device,
            dtype=dtype,
            backend="aot_eager" if quick else "inductor",
            extra={"time_steps": 2 if quick else 5},
        )
        try:
            out[f"autosp sac={sac}"] = measure_fake_world(case)
        except Exception as e:  # noqa: BLE001
            out[f"autosp sac={sac}"] = _failure(e)
    try:
        out["ulysses-compiled (hand-written)"] = _handwritten_step(model, seq, device, dtype, quick)
    except Exception as e:  # noqa: BLE001
        out["ulysses-compiled (hand-written)"] = _failure(e)
    out["failed"] = [k for k, v in out.items() if "error" in v]
    return out


def _handwritten_step(model: ModelConfig, seq: int, device: str, dtype: str, quick: bool) -> dict[str, Any]:
    """Compiled hand-written Ulysses (``autosp_tools.bench``), 2 ranks on the shared device over gloo."""
    from autosp_tools.launch import launch

    cfg = _Cfg(
        model=model,
        seq=seq,
        device=device,
        dtype=dtype,
        steps=2 if quick else 5,
        world=2,
        backend="aot_eager" if quick else "inductor",
    )
    return launch(_handwritten_rank, cfg)


def _handwritten_rank(cfg: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    import statistics

    import torch.distributed as dist

    from autosp_tools.bench.deepspeed_env import import_deepspeed
    from autosp_tools.bench.ulysses import UlyssesLM, all_reduce_grads, global_loss, shard_inputs
    from autosp_tools.model import build_model
    from autosp_tools.plan.api import DTYPES

    import_deepspeed()
    device = torch.device(cfg["device"], 0) if cfg["device"] == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    lm = build_model(cfg["model"]).to(device=device, dtype=DTYPES[cfg["dtype"]])
    model = UlyssesLM(lm, dist.group.WORLD)  # type: ignore[arg-type]  # the built-in impl is a LlamaLM
    fn = torch.compile(model, backend=cfg["backend"])
    ids = torch.randint(0, cfg["model"].vocab, (1, cfg["seq"]), generator=torch.Generator().manual_seed(1)).to(device)
    ids_l, targets, pos = shard_inputs(ids, ids, rank, world)
    times = []
    for i in range(cfg["steps"] + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss_sum, count = fn(ids_l, targets, pos)
        loss, _ = global_loss(loss_sum, count, dist.group.WORLD)
        loss.backward()
        all_reduce_grads(model, dist.group.WORLD)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return {"step_s": statistics.median(times)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="AutoSP's GPU checks; writes one JSON")
    ap.add_argument("--out", default=None, help="JSON path (default: $OUT/gpu_check.json, else ./gpu_check.json)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--quick", action="store_true", help="small sizes (the CPU self-test)")
    ap.add_argument("--stages", default="env,equivalence,flex,sac_kernels,step_time,plan_vs_measured,overlap_trace")
    ap.add_argument(
        "--combos",
        default=",".join(DEFAULT_COMBOS),
        help="equivalence's variant/backend/sac=... entries (default: each variant under aot_eager SAC off and "
        "inductor SAC on; 'all': both backends x SAC off/on)",
    )
    args = ap.parse_args(argv)
    out = Path(args.out) if args.out else Path(os.environ.get("OUT", ".")) / "gpu_check.json"
    # Parsed before any stage runs: a typo fails here.
    combos = tuple(map(_parse_combo, ALL_COMBOS if args.combos == "all" else args.combos.split(",")))
    check = Check(out)
    env = check.stage("env", lambda: env_info(args.device))
    if not env["ok"]:
        print(f"gpu_check: {env['error']}", file=sys.stderr)
        return 2
    stages: dict[str, Callable[[str, bool], Any]] = {
        "equivalence": functools.partial(equivalence, combos=combos),
        "sac_kernels": sac_kernels,
        "plan_vs_measured": plan_vs_measured,
        "step_time": step_time,
        "overlap_trace": functools.partial(overlap_trace, out=out),
        "flex": flex,
    }
    for name in args.stages.split(","):
        if name in stages:
            check.stage(name, functools.partial(stages[name], args.device, args.quick))
    check.data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    check.write()
    failed = [k for k, v in check.data["stages"].items() if not v["ok"]]
    print(f"[gpu_check] wrote {out}; failed stages: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
