"""The peak analysis of ``autosp_tools.bench.peak`` on traces whose answer is known."""

from __future__ import annotations

from autosp_tools.bench.peak import analyse


def _op(name: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}


def _mem(ts: float, nbytes: int, addr: int, tid: int = 1) -> dict:
    args = {"Bytes": nbytes, "Addr": addr, "Device Type": 0, "Total Allocated": 0}
    return {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "ts": ts, "tid": tid, "args": args}


def test_peak_live_buffers_their_ops_and_phases():
    trace = {
        "traceEvents": [
            _op("CompiledFunction", 0, 100),
            _op("## Call CompiledFxGraph fwd ##", 1, 98),
            _op("aten::mm", 10, 5),
            _op("graph_0_cpp_fused_mul_silu_view_2", 30, 5),
            _op("autograd::engine::evaluate_function: CompiledFunctionBackward", 200, 100),
            _op("CompiledFunctionBackward", 201, 98),
            _op("## Call CompiledFxGraph bwd ##", 202, 96),
            _op("aten::mm", 220, 5),
            _op("gloo_thread_op", 0, 400, tid=2),  # another thread's ops name nothing
            _mem(11, 1000, 0xA),  # inside aten::mm
            _mem(20, 500, 0xB),  # in the wrapper: the next op (the kernel) is named
            _mem(50, -500, 0xB),
            _mem(210, 4000, 0xC),  # backward, wrapper allocation before the mm
            _mem(221, 300, 0xD),  # the peak: 1000 + 4000 + 300
            _mem(230, -4000, 0xC),
            _mem(240, -300, 0xD),
            _mem(250, 700, 0xB),  # reuses an address: a new buffer, kept to the end
        ]
    }
    peak = analyse(trace)
    assert peak.peak == 5300
    assert peak.phase == "backward" and peak.op == "aten::mm"
    assert peak.phase_peaks == {"forward": 1500, "backward": 5300}
    assert peak.end == 1700
    assert [(b.nbytes, b.op, b.phase, b.kept) for b in peak.live] == [
        (4000, "aten::mm", "backward", False),
        (1000, "aten::mm", "forward", True),
        (300, "aten::mm", "backward", False),
    ]
    assert peak.by_op()[0] == ("backward", "aten::mm", 2, 4300)
    # The kernel of the freed 500-byte buffer is named without Inductor's graph prefix and serial number.
    freed = analyse({"traceEvents": trace["traceEvents"][:11]})
    assert [(b.nbytes, b.op) for b in freed.live] == [(1000, "aten::mm"), (500, "graph_0_cpp_fused_mul_silu_view_2")]
    assert freed.by_op()[1][1] == "cpp_fused_mul_silu_view"
