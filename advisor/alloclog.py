"""Every thread's live tensor bytes on a CPU process, exactly: a preloaded shim logs each tensor storage's
allocation and free, and the log's replay gives the peak.

On Linux, c10's CPU allocator takes every storage from posix_memalign (64-byte aligned) and gives it back through
free(). The profiler's memory events miss frees made on threads it does not follow (gloo's workers drop the
tensors of a finished collective there), so over gloo it over-reads; this log does not. The shim is built with gcc
into the data dir once and preloaded (LD_PRELOAD) into a process at its start; it logs only between `start` and
`stop`, one write(2) a call, so the calls of all threads land in their order. Where gcc is missing, `shim_path`
is None and nothing is logged.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
from pathlib import Path

SHIM_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
static int (*real_memalign)(void **, size_t, size_t);
static void (*real_free)(void *);
static volatile int fd = -1;
static void logline(const char *buf, int len) {
    int f = fd;
    if (f >= 0 && write(f, buf, len) < 0) fd = -1;
}
int advisor_alloc_log_start(const char *path) {
    fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND, 0644);
    return fd;
}
void advisor_alloc_log_stop(void) {
    int f = fd;
    fd = -1;
    if (f >= 0) close(f);
}
int posix_memalign(void **pp, size_t align, size_t n) {
    if (!real_memalign) real_memalign = dlsym(RTLD_NEXT, "posix_memalign");
    int r = real_memalign(pp, align, n);
    if (r == 0 && fd >= 0) { char b[64]; logline(b, snprintf(b, sizeof b, "m %zu %p\n", n, *pp)); }
    return r;
}
void free(void *p) {
    if (!real_free) real_free = dlsym(RTLD_NEXT, "free");
    if (fd >= 0 && p && ((uintptr_t)p & 63) == 0) { char b[48]; logline(b, snprintf(b, sizeof b, "f %p\n", p)); }
    real_free(p);
}
"""


def shim_path(directory: Path | None = None) -> str | None:
    """The compiled shim (built into `directory`, default the data dir's `alloclog/`, on first use), or None where
    it cannot be built (no gcc, not Linux)."""
    if not os.uname().sysname == "Linux":
        return None
    if directory is None:
        from advisor.settings import get_settings

        directory = get_settings().data_dir / "alloclog"
    digest = hashlib.sha256(SHIM_C.encode()).hexdigest()[:12]
    lib = Path(directory) / f"alloc_log-{digest}.so"
    if lib.exists():
        return str(lib)
    try:
        lib.parent.mkdir(parents=True, exist_ok=True)
        src = lib.with_suffix(".c")
        src.write_text(SHIM_C)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(tmp), str(src), "-ldl"], check=True,
                       capture_output=True, timeout=60)
        tmp.replace(lib)  # atomic: a concurrent builder's copy is the same library
    except (OSError, subprocess.SubprocessError):
        return None
    return str(lib)


def preload_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with the shim added to LD_PRELOAD where it can be built (unchanged otherwise)."""
    shim = shim_path()
    if shim is None:
        return env
    preload = env.get("LD_PRELOAD", "")
    return {**env, "LD_PRELOAD": f"{shim} {preload}".strip() if shim not in preload else preload}


def _lib() -> ctypes.CDLL | None:
    lib = ctypes.CDLL(None)
    return lib if hasattr(lib, "advisor_alloc_log_start") else None


def active() -> bool:
    """Whether this process runs under the shim."""
    return _lib() is not None


def start(path: str) -> bool:
    """Log this process's storage calls to `path` (truncated) from now on; False where the shim is not loaded."""
    lib = _lib()
    return lib is not None and lib.advisor_alloc_log_start(os.fsencode(path)) >= 0


def stop() -> None:
    """Stop logging (the file is complete when this returns)."""
    lib = _lib()
    if lib is not None:
        lib.advisor_alloc_log_stop()


def replay(path: str) -> int:
    """Peak of the live bytes of the storages a log records, its calls replayed in order (bytes): a storage freed
    without its allocation in the log (made before `start`) is not counted."""
    live: dict[str, int] = {}
    cur = peak = 0
    with open(path) as f:
        for line in f:
            kind, *rest = line.split()
            if kind == "m":
                live[rest[1]] = int(rest[0])
                cur += int(rest[0])
                peak = max(peak, cur)
            else:
                cur -= live.pop(rest[0], 0)
    return peak
