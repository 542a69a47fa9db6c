"""This process's resident set: now, and its peak since a mark (Linux /proc; ru_maxrss elsewhere).

`ru_maxrss` is not this process's own peak: Linux carries it over from the image an `exec`
replaced, so a fresh `python -m ...` started by a 2 GB parent (vfork shares the parent's memory
until the exec) reports at least 2 GB whatever it does itself, and a forked trial starts from its
fork server's peak. `mark_peak()` resets the kernel's high-water mark (VmHWM) to the current
resident set (`/proc/self/clear_refs`, Linux 4.0+), so `peak_rss()` afterwards is the peak of
what this process did since the mark.
"""

from __future__ import annotations

import os
import resource

# glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit (bytes): its dynamic mmap threshold rises no higher,
# so a request of this size and up is always mapped on its own, and MALLOC_MMAP_THRESHOLD_ takes no
# larger value.
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024


def malloc_env(mmap_threshold: int | None) -> dict[str, str]:
    """This process's environment for a child whose glibc maps requests of `mmap_threshold` bytes and up
    on their own (MALLOC_MMAP_THRESHOLD_) and trims its heap's top past twice that; glibc reads both once,
    when malloc first runs in the new process. None: both left to glibc's dynamic default, whatever this
    process was given."""
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}
    if mmap_threshold is not None:
        env.update(MALLOC_MMAP_THRESHOLD_=str(mmap_threshold), MALLOC_TRIM_THRESHOLD_=str(2 * mmap_threshold))
    return env


def set_malloc_thresholds(mmap_threshold: int) -> bool:
    """`malloc_env`'s thresholds set in this running process (glibc's mallopt: a process forked from a server
    that started without them, which reads no environment again); False where the C library is not glibc."""
    import ctypes
    import ctypes.util

    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(m_mmap_threshold, mmap_threshold)) and \
            bool(libc.mallopt(m_trim_threshold, 2 * mmap_threshold))
    except (OSError, AttributeError):
        return False


def available_bytes() -> int | None:
    """Memory the kernel says can be given to new work without swapping (MemAvailable, bytes), or None where
    /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def current_rss() -> int:
    """Resident set now (bytes)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_of(pid: int) -> int:
    """Resident set of process `pid` now (bytes; 0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def group_pids(pgid: int) -> list[int]:
    """The pids of the processes in process group `pgid` (from /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        if int(fields[2]) == pgid:  # fields after the command: state, ppid, pgrp, ...
            pids.append(int(entry))
    return pids


def group_pss(pgid: int) -> int:
    """Proportional set size of every process in the group (bytes): shared pages counted once."""
    total = 0
    for pid in group_pids(pgid):
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            continue
    return total


def mark_peak() -> bool:
    """Reset the peak to the resident set now; False where the kernel offers no reset."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    """Peak resident set (bytes) since `mark_peak()`, or since this process image started."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def resident_bytes(address: int, nbytes: int) -> int | None:
    """How many bytes of [address, address + nbytes) are in memory now (the pages mincore(2) says
    are resident; a page never written since it was mapped is not), or None where mincore is not
    available. A page partly inside the range counts whole."""
    import ctypes
    import ctypes.util

    if nbytes <= 0:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    start = address - address % page
    pages = (address + nbytes - start + page - 1) // page
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return min(nbytes, sum(v & 1 for v in vec) * page)
