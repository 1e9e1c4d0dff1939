"""Borrowing idle cores: a role that shares the machine's cores with the run's other processes (the learner and a
local-engine actor on one machine, each given one torch thread) takes one more thread for each core the others left
idle since it last looked, and gives it back as soon as they use it again.

Why look at the machine, not at Redis: whether an actor is waiting for room (backpressure) or the learner for a batch
is known in Redis, but whether they share this machine's cores is not; the CPU time the other processes used says
both at once, for any placement. Why give the thread back at once: two threads of one torch pool on a core another
process also wants wait on each other at every parallel region (a 40-problem evaluation took 44 s instead of 2.4 s
that way), so a borrowed thread must not outlive the idleness that justified it.

:func:`threads_for` is the pure rule; :class:`CoreBorrower` reads ``/proc/stat`` (the busy time of the cores this
process may run on) and the process's own CPU time, and sets torch's thread count before each piece of work."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("cores")

IDLE_SHARE = 0.75  # a core counts as idle when the other processes left at least this share of it unused
MIN_INTERVAL_S = 0.5  # shorter intervals say too little (the kernel counts in 10 ms ticks): keep the last choice


def threads_for(base: int, cores: int, others_busy: float) -> int:
    """Threads to use: ``base`` (the role's setting) plus one for every further core the other processes left idle,
    ``others_busy`` being the cores' worth of CPU time they used over the last interval."""
    spare = cores - base - others_busy  # cores' worth nobody else used, beyond the role's own threads
    return max(base, min(cores, base + int(spare + (1 - IDLE_SHARE))))


def busy_seconds(cpus: set[int], stat: Path = Path("/proc/stat")) -> float:
    """CPU seconds the cores ``cpus`` spent busy (all but idle and iowait) since boot, from the per-core lines."""
    tick = os.sysconf("SC_CLK_TCK")
    busy, seen = 0, 0
    for line in stat.read_text().splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
        busy += sum(ticks) - ticks[3] - ticks[4]
        seen += 1
    if not seen:  # a /proc/stat numbered apart from the affinity (a virtualised one): every core would look idle
        raise ValueError(f"no line of {stat} names the cores this process may run on ({sorted(cpus)[:8]})")
    return busy / tick


def quota_cores(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The cores' worth of CPU time the process's cgroup may use (a container's --cpus, a pod's limit); None
    without a quota. cgroup v2's cpu.max, or v1's cfs_quota_us over cfs_period_us."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (root / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (root / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota in ("max", "-1"):
        return None
    return max(1, -(-int(quota) // int(period)))


class CoreBorrower:
    """Sets torch's thread count before each forward or generation: the role's ``base`` threads, and the cores the
    other processes left idle since the last call (see the module's docstring)."""

    def __init__(
        self,
        base: int,
        set_threads: Callable[[int], None],
        busy: Callable[[], float] | None = None,
        own: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        cpus = os.sched_getaffinity(0)
        self.base, self.cores = base, min(len(cpus), quota_cores() or len(cpus))
        self.set_threads, self.own, self.clock = set_threads, own, clock
        self.busy = busy or (lambda: busy_seconds(cpus))
        self.threads = base
        self.borrowed_s = 0.0  # seconds run with more threads than base: how much borrowing happened
        self.off = False  # set when the machine's figures stop being readable mid-run
        self._since = self._sample()  # raises where they cannot be read at all: no borrower then

    def _sample(self) -> tuple[float, float, float]:
        return self.clock(), self.busy(), self.own()

    def adjust(self) -> int:
        """Choose the threads for the next piece of work from the interval since the last call that chose; cheap
        (a clock read) when called again within ``MIN_INTERVAL_S``, so it may be called at every decode step."""
        wall = self.clock() - self._since[0]
        if self.off or wall < MIN_INTERVAL_S:
            return self.threads
        try:
            now = self._sample()
        except (OSError, ValueError) as e:  # called from inside a forward or backward: never raise there
            log.warning("borrowing idle cores stops: %s; back to %d torch threads", e, self.base)
            self.off = True
            self.set_threads(self.base)
            self.threads = self.base
            return self.threads
        wall = now[0] - self._since[0]
        others = max(0.0, (now[1] - self._since[1]) - (now[2] - self._since[2])) / wall
        if self.threads > self.base:
            self.borrowed_s += wall
        threads = threads_for(self.base, self.cores, others)
        if threads != self.threads:
            log.debug(
                "torch threads %d -> %d (others used %.2f of %d cores)", self.threads, threads, others, self.cores
            )
            self.set_threads(threads)
            self.threads = threads
        self._since = now
        return threads


def core_borrower(enabled: bool, base: int) -> CoreBorrower | None:
    """A borrower for a role whose setting asks for one; None (with a warning) where ``/proc/stat`` is unreadable."""
    if not enabled:
        return None
    try:
        import torch

        return CoreBorrower(base, torch.set_num_threads)
    except (OSError, ValueError, AttributeError) as e:  # no /proc (not Linux), or no affinity call
        log.warning("borrowing idle cores is off: the cores' busy time cannot be read here (%s)", e)
        return None


def adjust_within(model: Any, adjust: Callable[[], object]) -> list[Any]:
    """Call ``adjust`` before each block of ``model`` (the members of its module lists: a transformer's layers) in
    the forward and, through a hook on the block's output, in the backward: one training forward and backward takes
    many seconds, and the other processes may start or stop waiting in the middle of it. The hooks' handles."""
    import torch

    def backward_hook(grad: torch.Tensor) -> torch.Tensor:
        adjust()
        return grad

    def before(_module: Any, _inputs: Any) -> None:  # None: a pre-hook's return value would replace the inputs
        adjust()

    def after(_module: Any, _inputs: Any, output: Any) -> None:
        first = output[0] if isinstance(output, tuple | list) else output
        if isinstance(first, torch.Tensor) and first.requires_grad:
            first.register_hook(backward_hook)

    handles = []
    for blocks in (m for m in model.modules() if isinstance(m, torch.nn.ModuleList)):
        for block in blocks:
            handles.append(block.register_forward_pre_hook(before))
            handles.append(block.register_forward_hook(after))
    return handles
