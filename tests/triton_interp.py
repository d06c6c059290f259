"""Shared by the tests that run Triton kernels on the CPU under the Triton interpreter
(TRITON_INTERPRET=1, numpy underneath): the skip when triton is missing, and the interpreter
patches the kernel checks run under (test-side only; not a test module).

Why `tl.dot` is patched: the interpreter computes each tile product with `np.matmul`, i.e. the BLAS
numpy ships. OpenBLAS picks its sgemm kernel by CPU, and with the AVX2 one (OpenBLAS "Haswell", also
chosen on AMD Zen) a row's bits depend on where the row sits in the matrix: row i of a batch sits at
tile row i % BLOCK_M, the same row decoded alone at tile row 0. Measured with numpy 2.4 / OpenBLAS
0.3.31 on an AVX2 EPYC: in a 64 x 32 @ 32 x 64 fp32 product, 34 of the 64 rows (6-11, 18-23, ...)
differ in their last bits from the same row placed at row 0; with OPENBLAS_CORETYPE=Sandybridge or
Nehalem none do (the suite passed on an AVX-512 machine, which gets another sgemm kernel). The
kernels promise that a row's arithmetic (tiles, K order, splits) does not depend on M; tests/gpu
checks the same claims on tensor cores. Here the dot is replaced by a product whose every element is
computed the same way wherever its row sits: products rounded to the accumulator's dtype, summed in
K order, then added to the accumulator (the interpreter's `matmul + acc` shape). So the bitwise
claims of the interpreter tests hold on any CPU and still fail when a kernel's tiling, K order or
split depends on M.

Each test file's interpreter run is one subprocess, minutes of numpy work in all; the runs of the
collected tests start in the background when collection ends (`start_runs`, from conftest.py),
as many at once as the machine has cores, so they use the cores that the tests running meanwhile
leave idle; a test reads its file's run when it finishes (`interpreter_run`).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

NEEDS_TRITON = (
    "CPU interpreter test: needs triton (the test extra installs triton==3.6.0 on Linux: "
    "pip install -e '.[test]')"
)


def require_triton() -> None:
    """Skip the calling test (or, at module level, the whole module) when triton is missing."""
    pytest.importorskip("triton", reason=NEEDS_TRITON)


def require_sm90_compiler() -> None:
    """Skip the calling test when this triton cannot compile for sm_90 on the CPU (triton
    missing, or built without its CUDA backend). A kernel's own compile error is not a skip: the
    test compiles after this and fails on it."""
    require_triton()
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError as e:
        pytest.skip(f"this triton has no CUDA backend to compile for sm_90: {e}")


def run_cases(cases, *leading) -> dict[str, str]:
    """In the interpreter process: each (name, check, args) case run as check(*leading, *args)
    -> "ok" or its failure text."""
    out = {}
    for name, fn, args in cases:
        try:
            fn(*leading, *args)
            out[name] = "ok"
        except Exception:  # noqa: BLE001 - reported per case to the parent process
            out[name] = traceback.format_exc(limit=3)
    return out


RUN_TIMEOUT_S = 300  # one file's run, from its start (measured: 15-55 s alone on 2 cores)
_RUNS: dict[str, Future] = {}  # test file -> its run's CompletedProcess
_PROCS: set[subprocess.Popen] = set()  # the runs under way
_POOL = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="interpreter")


def _run(script: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")  # as conftest.py: threads only oversubscribe here
    cmd = [sys.executable, script]
    out = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    with subprocess.Popen(cmd, env=env, **out) as proc:
        _PROCS.add(proc)
        try:
            stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            stderr += f"\ninterpreter run killed after {RUN_TIMEOUT_S} s"
        finally:
            _PROCS.discard(proc)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def start_runs(scripts) -> None:
    """Start the interpreter runs of `scripts` (test files) in the background, in this order."""
    for script in scripts:
        if str(script) not in _RUNS:
            _RUNS[str(script)] = _POOL.submit(_run, str(script))


def stop_runs() -> None:
    """Drop the runs not started yet and kill those under way (the session is over)."""
    _POOL.shutdown(wait=False, cancel_futures=True)
    for proc in list(_PROCS):
        proc.kill()


def interpreter_run(script: str) -> subprocess.CompletedProcess:
    """`script` (a test file) run as a program with TRITON_INTERPRET=1: the run `start_runs`
    started, or one started now. Fails the calling test if the run fails."""
    start_runs([script])
    proc = _RUNS[str(script)].result()
    if proc.returncode:
        pytest.fail(f"interpreter run failed:\n{proc.stderr[-3000:]}")
    return proc


@functools.cache
def interpreter_results(script: str) -> dict[str, str]:
    """`interpreter_run(script)`'s result, whose `__main__` prints `run_cases`' result as JSON
    on its last line."""
    return json.loads(interpreter_run(script).stdout.strip().splitlines()[-1])


def tile_dot(a, b, out_dtype):
    """a [..., M, K] @ b [..., K, N] in `out_dtype`, each element sum_k round(a[m, k] * b[k, n])
    added left to right: the same arithmetic for every element, on every CPU (numpy's cumsum is
    a sequential accumulate)."""
    import numpy as np

    prods = a.astype(out_dtype)[..., :, :, None] * b.astype(out_dtype)[..., None, :, :]
    return np.cumsum(prods, axis=-2, dtype=out_dtype)[..., -1, :]  # [..., M, N]


def patch_interpreter() -> None:
    """Call in the TRITON_INTERPRET=1 process before any kernel runs. Fixes, for triton 3.6 with
    numpy 2: `tl.dot` (position-independent rows, see above; bf16 operands are read as the
    values they hold, not as their raw uint16 bits), and loop bounds loaded from memory (1-element
    arrays, which `int()` refuses)."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as ti

    patch_tensor = ti._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def values(h):
        if h.dtype.scalar == tl.bfloat16:
            return (h.data.astype(np.uint32) << 16).view(np.float32)
        if h.dtype.is_floating() and h.dtype.primitive_bitwidth == 8:
            return ti._convert_float(h.data, h.dtype, tl.float16, None).view(np.float16)
        return h.data

    create_dot = ti.InterpreterBuilder.create_dot

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not np.issubdtype(d.data.dtype, np.floating):  # integer dots are exact anyway
            return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = tile_dot(values(a), values(b), d.data.dtype) + d.data
        return ti.TensorHandle(out, d.dtype.scalar)

    ti._patch_lang_tensor = patched
    ti.InterpreterBuilder.create_dot = dot
