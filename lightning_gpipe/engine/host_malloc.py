"""Keep the host memory a step frees for the next step: glibc's malloc thresholds for a pipeline stage on the CPU.

A training step on the CPU allocates its activations and frees them again, the same sizes every step.
glibc's malloc serves a block above its mmap threshold (128 KiB at first, raised by itself up to 32 MiB as
large blocks are freed) with a fresh ``mmap`` and gives it back with ``munmap``, and it returns the free
top of its heap to the system once that exceeds its trim threshold. Either way the next step faults the
same pages in again, zeroed by the kernel. A fill-drain step frees a whole batch's activations at once
in the drain, so it pays this every step. Measured on this project's 2-core VM
(``benchmarks/trainer.py``'s VGG-style stack, K=2, M=8, batch 64): a step of 190-200 ms with the
thresholds below against 215-249 ms with glibc's own in single runs, 200 against 223 ms in the medians
of 3 rounds; with only the trim threshold raised (which freezes the mmap threshold at 128 KiB) 428 ms.
One process running the same model alone measured no difference (285-292 ms either way):
two processes faulting pages at once is what costs.

So a stage on the CPU sets the mmap threshold to glibc's largest (32 MiB) and the trim threshold to the
largest ``mallopt`` takes (2 GiB): blocks up to 32 MiB come from the heap and go back to it, and the heap
keeps its free top. The process's resident set then stays near its peak between steps instead of
falling back; the peak itself hardly moves (stage 0's, as PipelineMonitor reads it: 884-888 MiB before,
890-893 MiB after). Nothing here is Lightning's or torch's to do (torch's
CPU allocator calls ``malloc`` directly and has no cache), hence ``mallopt`` through ``ctypes``.
"""

from __future__ import annotations

import ctypes
import os
import platform
from typing import Optional

__all__ = ["MALLOC_ENV", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory", "set_thresholds"]

#: glibc's largest mmap threshold on 64-bit systems (``HEAP_MAX_SIZE / 2``); ``mallopt`` refuses more.
MMAP_THRESHOLD = 32 * 2**20
#: The largest value ``mallopt`` takes (an ``int``): in practice, never trim the heap's top.
TRIM_THRESHOLD = 2**31 - 1
#: Environment variables through which a user tunes glibc's malloc; where one is set, the user decided.
MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)


def set_thresholds(mmap: int, trim: int) -> Optional[str]:
    """Set glibc's mmap and trim thresholds (bytes) for this process; ``None`` when done, else why not."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return f"the C library is not glibc ({platform.system()} {platform.libc_ver()[0] or 'unknown'})"
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError) as error:
        return f"glibc's mallopt is not reachable ({error})"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(_M_MMAP_THRESHOLD, mmap) and mallopt(_M_TRIM_THRESHOLD, trim)):
        return "glibc's mallopt refused the thresholds"
    return None


def keep_freed_memory() -> Optional[str]:
    """Set this process's malloc to keep freed blocks for reuse; ``None`` when done, else why it was not.

    Left alone: a C library other than glibc (``mallopt`` differs or is absent), and a process whose
    environment already tunes glibc's malloc (``MALLOC_ENV``: the user's choice wins, and the memory
    benchmarks set it to read live tensors from the resident set).
    """
    tuned = [name for name in MALLOC_ENV if name in os.environ]
    if tuned:
        return f"the environment sets {', '.join(tuned)}"
    return set_thresholds(MMAP_THRESHOLD, TRIM_THRESHOLD)
