"""torch's CPU thread count for an engine process: one function, called when a CPU engine starts.

Intra-op threads beyond the cores a process may run on only add contention, and tensor-parallel
ranks on one host (gloo workers, Ray actors) each start with torch's default of every physical
core, so two ranks on a 2-core machine would run four threads on two cores. Cores that other
processes keep busy count as taken too: an op split over two threads waits for the one the
scheduler took away, at every op (measured on the shared 2-core CPU machine while another
process ran: a 13 ms decode step took 0.1-0.6 s with 2 threads, a 34 ms DDTree step 0.1-3 s;
with 1 thread they stayed at 13 and 34 ms). The count is chosen once, at start; where the load
changes later, pin it with DDSERVE_CPU_THREADS (or EngineConfig.cpu_threads).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ENV = "DDSERVE_CPU_THREADS"


def usable_cpus() -> list[int]:
    """The logical CPUs this process may run on (its affinity mask)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return list(range(os.cpu_count() or 1))


def physical_cores(cpus: list[int]) -> int:
    """Distinct physical cores among `cpus` (SMT siblings count once), from sysfs topology;
    len(cpus) where the topology cannot be read."""
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package = (topo / "physical_package_id").read_text().strip()
            cores.add((package, (topo / "core_id").read_text().strip()))
        except OSError:
            return len(cpus)
    return len(cores) or len(cpus)


def cpu_threads(ranks_on_host: int = 1, requested: int | None = None) -> tuple[int, str]:
    """(threads, why): `requested` (EngineConfig.cpu_threads) first, then $DDSERVE_CPU_THREADS;
    else this rank's share of the physical cores the process may use (split evenly between the
    ranks on the host, at least 1), never more than torch's current count (which is already
    OMP_NUM_THREADS, e.g. a Ray actor's CPUs, or a lower count the process chose)."""
    if requested is not None:
        return _positive(requested, "EngineConfig.cpu_threads"), "config"
    if os.environ.get(ENV, "").strip():
        return _positive(int(os.environ[ENV]), ENV), ENV
    cores = physical_cores(usable_cpus())
    share = max(1, cores // max(1, ranks_on_host))
    why = f"{cores} physical core(s) usable / {ranks_on_host} rank(s) on this host"
    idle = idle_cores()
    if idle is not None and idle < share:
        share, why = max(1, idle), f"{why}, but only ~{idle} idle (1-min load average)"
    now = torch.get_num_threads()
    return (share, why) if share <= now else (now, f"torch's current count; {why}")


def idle_cores() -> int | None:
    """Cores of this machine the other processes leave idle: CPU count minus the 1-minute load
    average, rounded (None where the load average is unknown)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # pragma: no cover - not Unix
        return None
    return max(0, round((os.cpu_count() or 1) - load))


def configure_cpu_threads(ranks_on_host: int = 1, requested: int | None = None) -> int:
    """Set torch's intra-op threads (`cpu_threads`) and log the choice; returns the count."""
    n, why = cpu_threads(ranks_on_host, requested)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    log.info("CPU engine: %d torch thread(s) (%s)", n, why)
    return n


def _positive(n: int, what: str) -> int:
    if n < 1:
        raise ValueError(f"{what} must be >= 1, got {n}")
    return n
