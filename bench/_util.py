"""Timing helpers shared by the GPU benchmarks: graph replay, median of events, ceilings."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import torch


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def capture_graph(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """fn run once on a side stream (lazy inits, autotuning), then captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def time_ms(fn: Callable[[], object], graph: bool = True, rep: int = 100) -> float:
    """Median milliseconds per call. On CUDA: captured into a CUDA graph when `graph` (launch gaps
    gone, as in the engine's captured step), then timed with triton's do_bench (events, L2 flushed
    between calls). On CPU (smoke runs) one wall-clock call."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    fn()
    torch.cuda.synchronize()
    run = fn
    if graph:
        try:
            run = capture_graph(fn).replay
        except Exception as e:  # noqa: BLE001 - report and time without a graph
            print(f"  (graph capture failed: {type(e).__name__}: {str(e)[:120]}; timing eagerly)")
            torch.cuda.synchronize()
    return float(triton.testing.do_bench(run, warmup=25, rep=rep, return_mode="median"))


def copy_bandwidth_gbs(nbytes: int = 2**31) -> float:
    """Device-to-device copy, bytes read + written, GB/s (1e9)."""
    if not torch.cuda.is_available():
        return float("nan")
    src = torch.empty(nbytes // 4, dtype=torch.int32, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), graph=False)
    return 2 * nbytes / ms / 1e6


def matmul_tflops(n: int = 8192) -> float:
    if not torch.cuda.is_available():
        return float("nan")
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = time_ms(lambda: a @ b, graph=False)
    return 2 * n**3 / ms / 1e9


def environment() -> dict:
    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "torch": torch.__version__}
    if torch.cuda.is_available():
        import triton

        env.update(device=torch.cuda.get_device_name(), triton=triton.__version__)
    return env


def write_json(path: str | None, obj: dict) -> None:
    text = json.dumps(obj, indent=1)
    if path:
        with open(path, "w") as f:
            f.write(text)
    print(f"wrote {path}" if path else text[:2000])


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()
