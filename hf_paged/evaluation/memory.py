"""Peak memory growth of one run, measured on its own although many runs share one process.

On Linux/CPU, before every run the garbage collector and ``malloc_trim(0)`` return freed memory to the OS and
the peak-RSS counter (VmHWM) is reset through /proc/self/clear_refs; a run's peak growth is VmHWM after it
minus VmRSS before it. On CUDA it is ``torch.cuda.max_memory_allocated()`` minus ``memory_allocated()`` before
the run. Elsewhere, the growth of ``getrusage``'s lifetime maximum RSS (0 when an earlier run peaked higher).
"""

from __future__ import annotations

import ctypes
import gc
import re
import sys

_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim  # noqa: B018  (glibc only)
        except (OSError, AttributeError):
            _LIBC = False
    return _LIBC


def _proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
        return int(m.group(1)) if m else None
    except OSError:
        return None


def _can_reset_hwm() -> bool:
    if _proc_status_kib("VmHWM") is None:
        return False
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _max_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


class MemoryMeter:
    """``start()`` before a run, ``stop()`` after it -> its peak memory growth in bytes; ``method`` says how."""

    def __init__(self, device):
        import torch

        self.torch = torch
        self.cuda = device.type == "cuda"
        self.hwm = not self.cuda and _can_reset_hwm()
        if self.cuda:
            self.method = "cuda: torch.cuda.max_memory_allocated() - memory_allocated() before the run"
        elif self.hwm:
            trim = " + malloc_trim(0)" if _libc() else ""
            self.method = ("process RSS: VmHWM after the run - VmRSS before it; before each run gc.collect()"
                           f"{trim} and a VmHWM reset via /proc/self/clear_refs")
        else:
            self.method = ("process RSS: growth of resource.getrusage().ru_maxrss over the run (a lifetime "
                           "maximum: 0 when an earlier run peaked higher)")

    def start(self) -> None:
        gc.collect()
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.empty_cache()
            self.torch.cuda.reset_peak_memory_stats()
            self.before = self.torch.cuda.memory_allocated()
        elif self.hwm:
            if _libc():
                _libc().malloc_trim(0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.before = _proc_status_kib("VmRSS") * 1024
        else:
            self.before = _max_rss_bytes()

    def stop(self) -> int:
        if self.cuda:
            self.torch.cuda.synchronize()
            return int(self.torch.cuda.max_memory_allocated() - self.before)
        if self.hwm:
            return max(0, _proc_status_kib("VmHWM") * 1024 - self.before)
        return max(0, _max_rss_bytes() - self.before)
