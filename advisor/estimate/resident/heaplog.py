"""glibc's heap at a batch no run reached: a calibration run's own allocations, rescaled and replayed.

A CPU run's resident set is what glibc's heap keeps: freed chunks stay resident until reused, and which
freed chunk a later request reuses depends on the sizes and order of every request, the small ones
between tensors included (they pin freed tensors' chunks apart, so they cannot merge). A line through
runs at a fraction of the batch cannot see where that reuse changes: vit-b16 at 112 px grows ~20 MiB a
sample from 2 to 8 and barely from 12 to 16, where its activations' chunks grow past the gradients' and
start holding them.

So a calibration run logs every allocation and free it makes from the build to its last step (an
LD_PRELOAD shim over malloc, calloc, realloc, posix_memalign, memalign, aligned_alloc and free, compiled
here on first use with the system's C compiler). The tensors' requests (torch's CPU allocator calls
posix_memalign) are rescaled from the run's batch to the one asked about as the estimator's trace rescales
them (`rescaled`); everything else stays as logged. A small replayer makes the same requests in the same
order through this machine's glibc, writing every byte, and reports its peak resident set, several times
with a few bytes held first (DRAWS). The prediction at the batch is the median of the rescaled logs' draws
plus what the runs measured over their own logs' draws (the process's other pages). Where no C compiler
or no glibc is found, nothing is logged and the estimate says so.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from advisor.procmem import malloc_env

# The environment variable that tells a measured run (advisor.measure, rss mode) where to log.
LOG_ENV = "ADVISOR_HEAP_LOG"
# One record: (operation, returned pointer, bytes, old pointer for realloc / alignment), 4 x uint64. A MARK
# record (MARK, 0, the phase's number, 0) says where the run's steps enter their next phase (`phase_marks`).
FIELDS = 4
MALLOC, CALLOC, FREE, REALLOC, POSIX_MEMALIGN, MEMALIGN, ALIGNED_ALLOC, MARK = range(1, 9)

SHIM_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
typedef struct { uint64_t op, ptr, size, extra; } rec_t;
enum { BUF = 16384 };
static rec_t buf[BUF];
static int nbuf, fd = -1, initing;
static volatile int lk;
static char boot[65536];
static size_t bootn;
static void *(*r_malloc)(size_t);
static void (*r_free)(void *);
static void *(*r_calloc)(size_t, size_t);
static void *(*r_realloc)(void *, size_t);
static int (*r_pm)(void **, size_t, size_t);
static void *(*r_memalign)(size_t, size_t);
static void *(*r_aligned)(size_t, size_t);
static void init(void) {
  if (r_malloc || initing) return;
  initing = 1;
  r_calloc = dlsym(RTLD_NEXT, "calloc"); r_free = dlsym(RTLD_NEXT, "free");
  r_realloc = dlsym(RTLD_NEXT, "realloc"); r_pm = dlsym(RTLD_NEXT, "posix_memalign");
  r_memalign = dlsym(RTLD_NEXT, "memalign"); r_aligned = dlsym(RTLD_NEXT, "aligned_alloc");
  r_malloc = dlsym(RTLD_NEXT, "malloc");
  initing = 0;
}
static void flush(void) {
  size_t left = nbuf * sizeof(rec_t); const char *p = (const char *)buf;
  while (left > 0) { ssize_t w = write(fd, p, left); if (w <= 0) break; p += w; left -= w; }
  nbuf = 0;
}
static void rec(uint64_t op, void *p, size_t s, uint64_t x) {
  if (fd < 0) return;
  while (__sync_lock_test_and_set(&lk, 1)) {}
  if (fd >= 0) { buf[nbuf].op = op; buf[nbuf].ptr = (uint64_t)p; buf[nbuf].size = s; buf[nbuf].extra = x;
                 if (++nbuf == BUF) flush(); }
  __sync_lock_release(&lk);
}
int advisor_heaplog_start(const char *path) {
  int f = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (f < 0) return -1;
  while (__sync_lock_test_and_set(&lk, 1)) {}
  nbuf = 0; fd = f;
  __sync_lock_release(&lk);
  return 0;
}
int advisor_heaplog_mark(uint64_t tag) { rec(8, 0, tag, 0); return 0; }
int advisor_heaplog_stop(void) {
  while (__sync_lock_test_and_set(&lk, 1)) {}
  if (fd >= 0) { flush(); close(fd); fd = -1; }
  __sync_lock_release(&lk);
  return 0;
}
static int in_boot(void *p) { return (char *)p >= boot && (char *)p < boot + sizeof boot; }
static void *boot_alloc(size_t s) {
  if (bootn + s > sizeof boot) return 0;
  void *p = boot + bootn; bootn += (s + 15) & ~(size_t)15; return p;
}
void *malloc(size_t s) {
  if (!r_malloc) init();
  if (!r_malloc) return boot_alloc(s);
  void *p = r_malloc(s); if (p) rec(1, p, s, 0); return p;
}
void *calloc(size_t n, size_t s) {
  if (!r_calloc) init();
  if (!r_calloc) { void *p = boot_alloc(n * s); if (p) memset(p, 0, n * s); return p; }
  void *p = r_calloc(n, s); if (p) rec(2, p, n * s, 0); return p;
}
void free(void *p) {
  if (!p || in_boot(p)) return;
  if (!r_free) init();
  rec(3, p, 0, 0); r_free(p);
}
void *realloc(void *o, size_t s) {
  if (in_boot(o)) { void *p = malloc(s); if (p) memcpy(p, o, s); return p; }
  if (!r_realloc) init();
  void *p = r_realloc(o, s); if (p || !s) rec(4, p, s, (uint64_t)o); return p;
}
int posix_memalign(void **pp, size_t a, size_t s) {
  if (!r_pm) init();
  int r = r_pm(pp, a, s); if (!r) rec(5, *pp, s, a); return r;
}
void *memalign(size_t a, size_t s) {
  if (!r_memalign) init();
  void *p = r_memalign(a, s); if (p) rec(6, p, s, a); return p;
}
void *aligned_alloc(size_t a, size_t s) {
  if (!r_aligned) init();
  void *p = r_aligned(a, s); if (p) rec(7, p, s, a); return p;
}
"""

REPLAY_C = r"""
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
typedef struct { uint64_t op, ptr, size, extra; } rec_t;
static long status(const char *key) {
  FILE *f = fopen("/proc/self/status", "r"); char l[256]; long v = -1; size_t k = strlen(key);
  if (!f) return -1;
  while (fgets(l, sizeof l, f)) if (!strncmp(l, key, k)) { v = atol(l + k + 1); break; }
  fclose(f); return v * 1024;
}
static uint64_t *hk; static void **hv; static uint64_t mask;
static uint64_t h(uint64_t k) { k ^= k >> 33; k *= 0xff51afd7ed558ccdULL; k ^= k >> 33; return k & mask; }
static void put(uint64_t k, void *v) {
  uint64_t i = h(k); while (hk[i] && hk[i] != k && hk[i] != 1) i = (i + 1) & mask; hk[i] = k; hv[i] = v;
}
static void *take(uint64_t k) {
  uint64_t i = h(k);
  while (hk[i]) { if (hk[i] == k) { hk[i] = 1; return hv[i]; } i = (i + 1) & mask; }
  return 0;
}
int main(int argc, char **argv) {
  if (argc < 2) return 2;
  /* argv[2], a draw's seed: where not 0, the heap starts with 16 B to 128 KiB held, so every chunk after
     lies that far along (its page boundaries and its alignment's padding move) */
  uint64_t seed = argc > 2 ? strtoull(argv[2], 0, 10) : 0, x = seed * 0x9e3779b97f4a7c15ULL + 1;
  FILE *f = fopen(argv[1], "rb"); if (!f) return 2;
  fseek(f, 0, SEEK_END); long n = ftell(f) / (long)sizeof(rec_t); fseek(f, 0, SEEK_SET);
  rec_t *r = malloc((n + 1) * sizeof(rec_t));
  if (!r || fread(r, sizeof(rec_t), n, f) != (size_t)n) return 2;
  fclose(f);
  uint64_t cap = 1; while (cap < 2 * (uint64_t)n + 16) cap <<= 1;
  mask = cap - 1; hk = calloc(cap, sizeof *hk); hv = calloc(cap, sizeof *hv);
  if (!hk || !hv) return 2;
  memset(hk, 0, cap * sizeof *hk); memset(hv, 0, cap * sizeof *hv);
  long base = status("VmRSS:");
  FILE *c = fopen("/proc/self/clear_refs", "w"); if (c) { fputs("5", c); fclose(c); }
  if (seed) {
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    size_t z = 16 * (1 + x % 8192); void *q = malloc(z); if (q) memset(q, 1, z);
    fprintf(stderr, "held %zu\n", z);
  }
  for (long i = 0; i < n; i++) {
    rec_t e = r[i]; void *p = 0;
    if (e.op == 8) continue; /* a phase mark */
    if (e.op == 3) { void *q = take(e.ptr); if (q) free(q); continue; }
    if (e.op == 4) {
      void *q = e.extra ? take(e.extra) : 0;
      p = q ? realloc(q, e.size) : (e.size ? malloc(e.size) : 0);
    } else if (e.op == 1) p = malloc(e.size);
    else if (e.op == 2) p = calloc(1, e.size);
    else if (posix_memalign(&p, e.extra >= sizeof(void *) ? e.extra : sizeof(void *), e.size)) p = 0;
    if (p && e.size) memset(p, 1, e.size);
    if (p && e.ptr) put(e.ptr, p);
  }
  printf("%ld\n", status("VmHWM:") - base);
  return 0;
}
"""


class Tools(NamedTuple):
    shim: Path  # the LD_PRELOAD library that logs
    replay: Path  # the replayer


def tools() -> Tools | None:
    """The logger and replayer, compiled on first use into the data dir (kept by their sources' hash), or
    None where they cannot be: not Linux with glibc, or no C compiler (`CC`, else cc or gcc)."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    from advisor.settings import get_settings

    digest = hashlib.sha256((SHIM_C + REPLAY_C).encode()).hexdigest()[:12]
    d = get_settings().data_dir / "heaplog" / digest
    out = Tools(shim=d / "heaplog.so", replay=d / "replay")
    if out.shim.exists() and out.replay.exists():
        return out
    return out if _build(d) else None


_FAILED: set[Path] = set()  # directories where building failed in this process: not tried again


def _build(d: Path) -> bool:
    """Compile both into `d`; False where that fails."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None or d in _FAILED:
        return False
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=d) as tmp:
            for name, source, flags in (("heaplog.so", SHIM_C, ["-shared", "-fPIC"]), ("replay", REPLAY_C, [])):
                src = Path(tmp) / (name.split(".")[0] + ".c")
                src.write_text(source)
                subprocess.run([cc, "-O2", *flags, "-o", str(Path(tmp) / name), str(src), "-ldl"],
                               check=True, capture_output=True, timeout=120)
            for name in ("heaplog.so", "replay"):
                os.replace(Path(tmp) / name, d / name)
    except (OSError, subprocess.SubprocessError):
        _FAILED.add(d)
        return False
    return True


def run_env(log_path: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a measured run that logs its allocations to `log_path` (`tools()` must be built)."""
    t = tools()
    assert t is not None
    env = dict(os.environ if env is None else env)
    env["LD_PRELOAD"] = " ".join(filter(None, [str(t.shim), env.get("LD_PRELOAD", "")]))
    env[LOG_ENV] = log_path
    return env


def start_logging() -> bool:
    """In a measured run: start logging where LOG_ENV names a file and the shim is loaded (else False)."""
    path = os.environ.get(LOG_ENV)
    if not path:
        return False
    try:
        start = ctypes.CDLL(None).advisor_heaplog_start
    except AttributeError:  # the shim did not load
        return False
    start.argtypes = [ctypes.c_char_p]
    return start(path.encode()) == 0


def stop_logging() -> None:
    ctypes.CDLL(None).advisor_heaplog_stop()


def phase_marks() -> Callable[[str], None]:
    """In a logged run (`start_logging`): a callback for each phase the run's steps enter ("batch" before each
    batch is made, then `train_step`'s), that marks it in the log with a MARK record numbered from 1, as
    Trace.phases numbers the trace's phases after the build's 0."""
    mark = ctypes.CDLL(None).advisor_heaplog_mark
    mark.argtypes = [ctypes.c_uint64]
    count = itertools.count(1)
    return lambda _name: mark(next(count))


def read_log(path: str | Path) -> np.ndarray:
    """(records, FIELDS) uint64."""
    return np.fromfile(path, dtype=np.uint64).reshape(-1, FIELDS)


def size_map(sizes_from: np.ndarray, sizes_to: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted sizes, what each becomes) between two traces of one step at two batch sizes (Trace.sizes:
    +bytes per allocation, in the same order at both): each size as most of its allocations map it. An allocation
    is one of `sizes_from`'s positive entries; it may be 0 bytes at the other batch (a probed op's scratch)."""
    grows = sizes_from > 0
    a, b = sizes_from[grows], np.maximum(sizes_to[grows], 0)
    pairs, counts = np.unique(np.stack([a, b], axis=1), axis=0, return_counts=True)
    order = np.lexsort((-counts, pairs[:, 0]))  # by size, the most frequent target first
    pairs = pairs[order]
    first = np.ones(len(pairs), bool)
    first[1:] = pairs[1:, 0] != pairs[:-1, 0]
    return pairs[first, 0].astype(np.uint64), pairs[first, 1].astype(np.uint64)


def traced_phase(logged: np.ndarray) -> np.ndarray:
    """The trace's phase for each of a logged run's phases (numbered as `phase_marks` numbers them, after the
    build's 0): the same up to the trace's last step (trace.TRACED_STEPS); a step past it, that step's phases."""
    from advisor.estimate.trace import STEP_PHASES, TRACED_STEPS

    per_step = len(STEP_PHASES)
    last_from = 1 + (TRACED_STEPS - 1) * per_step
    return np.where(logged < last_from + per_step, logged, last_from + (logged - last_from) % per_step)


def rescaled(log: np.ndarray, sizes_run: np.ndarray, sizes_target: np.ndarray,
             phases: np.ndarray | None = None) -> np.ndarray:
    """The log with its tensors' requests resized from the run's batch to the target's (Trace.sizes at both, in
    the same order; `phases`: Trace.phases of them). Each size as the trace resizes most of its allocations
    (`size_map`, `rescale`), and, where the log marks its phases (`phase_marks`) and the trace resizes
    allocations of one size in different ways (a weight as large as an activation: the one stays, the other
    grows), each such request as the trace resizes the allocation of that size it matches in order within the
    same phase; requests past the trace's there as most of that phase's of that size (by size alone, a
    WGAN-GP critic's 2 MiB weights grew with the batch as its 2 MiB activations do).
    Evidence: bench/research/heap_rescale.py, bench/results/archive/heap_rescale.jsonl"""
    out = rescale(log, *size_map(sizes_run, sizes_target))
    marks = log[:, 0] == MARK
    if phases is None or not marks.any():
        return out
    grows = sizes_run > 0
    run, to, ph = sizes_run[grows], np.maximum(sizes_target[grows], 0), phases[grows]
    pairs = np.unique(np.stack([run, to], axis=1), axis=0)
    sizes, ways = np.unique(pairs[:, 0], return_counts=True)
    ambiguous = sizes[ways > 1]
    if not len(ambiguous):
        return out
    targets: dict[tuple[int, int], list[int]] = {}
    for i in np.flatnonzero(np.isin(run, ambiguous)):
        targets.setdefault((int(ph[i]), int(run[i])), []).append(int(to[i]))
    most = {k: Counter(v).most_common(1)[0][0] for k, v in targets.items()}
    logged = np.cumsum(marks)
    phase = traced_phase(logged)
    seen: Counter[tuple[int, int]] = Counter()
    for i in np.flatnonzero((log[:, 0] == POSIX_MEMALIGN) & np.isin(log[:, 2].astype(np.int64), ambiguous)):
        size = int(log[i, 2])
        key = (int(phase[i]), size)
        if key not in targets:
            continue
        k = seen[(int(logged[i]), size)]
        seen[(int(logged[i]), size)] += 1
        out[i, 2] = targets[key][k] if k < len(targets[key]) else most[key]
    return out


def rescale(log: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The log with its tensors' requests (posix_memalign) resized by `size_map`'s mapping; sizes it does
    not know stay."""
    out = log.copy()
    tensors = out[:, 0] == POSIX_MEMALIGN
    sizes = out[tensors, 2]
    if len(keys):
        i = np.minimum(np.searchsorted(keys, sizes), len(keys) - 1)
        known = keys[i] == sizes
        sizes[known] = values[i[known]]
        out[tensors, 2] = sizes
    return out


# Draws of the heap per log (seeds 0 to DRAWS - 1). glibc's heap is chaotic in its history: the same log replayed
# with 16 B to 128 KiB held first peaks up to 25% apart, as fresh processes of one run do; the median of several
# draws is the middle a user's run draws from (the prediction moves 3-4% with the seeds at one draw per log, 2-3%
# at three). Evidence: bench/research/heap_draws.py, bench/results/archive/heap_draws.jsonl
DRAWS = 3


def replay(log_path: str | Path, mmap_threshold: int | None = None, timeout_s: float = 300.0, seed: int = 0) -> int:
    """The peak resident set (bytes over the replayer's own before it starts) of a log's requests made
    through this machine's glibc in order, every byte written; `mmap_threshold`: glibc's, fixed as the run
    fixed it (None: glibc's dynamic default); `seed`: a draw (DRAWS), 0 for the heap as the replayer finds it."""
    t = tools()
    assert t is not None
    proc = subprocess.run([str(t.replay), str(log_path), str(seed)], capture_output=True, text=True,
                          timeout=timeout_s, env=malloc_env(mmap_threshold), check=True)
    return int(proc.stdout.strip())


class Replayed(NamedTuple):
    """One logged run's heap, replayed at its own batch and at the target's."""

    excess: int  # what the run measured over the median of its own log's draws (bytes): the process's other pages
    at_target: tuple[int, ...]  # the draws of its log rescaled to the target batch (bytes)


def replay_at(log_path: str | Path, measured: int, mmap_threshold: int | None, sizes_run: np.ndarray,
              sizes_target: np.ndarray, draws: int = DRAWS, phases: np.ndarray | None = None) -> Replayed:
    """One logged run's draws: its log replayed at its own batch (under the threshold it ran with) and rescaled
    to the target's (`rescaled`; under glibc's default, as a user runs it), `draws` seeds each."""
    own = float(np.median([replay(log_path, mmap_threshold, seed=s) for s in range(draws)]))
    with tempfile.NamedTemporaryFile(suffix=".heaplog", dir=Path(log_path).parent, delete=False) as f:
        scaled = f.name
    try:
        rescaled(read_log(log_path), sizes_run, sizes_target, phases).tofile(scaled)
        return Replayed(int(measured - own), tuple(replay(scaled, seed=s) for s in range(draws)))
    finally:
        os.unlink(scaled)


def pooled(runs: list[Replayed]) -> int:
    """The resident-set increase at the target batch (bytes) from logged runs' draws: the median of every draw
    at the target, plus the runs' mean excess."""
    return int(np.median([d for r in runs for d in r.at_target]) + np.mean([r.excess for r in runs]))


def predict(log_path: str | Path, measured: int, mmap_threshold: int | None, sizes_run: np.ndarray,
            sizes_target: np.ndarray, draws: int = DRAWS, phases: np.ndarray | None = None) -> int:
    """The resident-set increase at the target batch (bytes) from one logged run (`replay_at`, `pooled`)."""
    return pooled([replay_at(log_path, measured, mmap_threshold, sizes_run, sizes_target, draws, phases)])
