/* LD_PRELOAD shim for bench/research/malloc_replay.py: logs every malloc-family call and free of the process
 * while the environment variable MALLOC_LOG names a file (set by the process itself once it wants
 * logging to start), one line per call: "<kind> <bytes> <pointer> [<old pointer>]". The calls go to
 * glibc's own functions; the log is written with write(2), so logging allocates nothing.
 * Build: gcc -shared -fPIC -O2 -o malloc_log.so malloc_log.c -ldl */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static void *(*real_malloc)(size_t);
static void *(*real_calloc)(size_t, size_t);
static void *(*real_realloc)(void *, size_t);
static int (*real_posix_memalign)(void **, size_t, size_t);
static void (*real_free)(void *);
static __thread int busy;
static int fd = -1;

static void logline(const char *kind, size_t n, void *p, void *old) {
    if (busy) return;
    busy = 1;
    if (fd < 0) {
        const char *path = getenv("MALLOC_LOG");
        if (path) fd = open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
    }
    if (fd >= 0 && getenv("MALLOC_LOG")) {
        char buf[96];
        int len = old ? snprintf(buf, sizeof buf, "%s %zu %p %p\n", kind, n, p, old)
                      : snprintf(buf, sizeof buf, "%s %zu %p\n", kind, n, p);
        if (write(fd, buf, len) < 0) fd = -1;
    }
    busy = 0;
}

void *malloc(size_t n) {
    if (!real_malloc) real_malloc = dlsym(RTLD_NEXT, "malloc");
    void *p = real_malloc(n);
    logline("malloc", n, p, NULL);
    return p;
}

/* dlsym itself may call calloc before real_calloc is known: serve that from a static pool (never freed). */
static char early[8192];
static size_t used;

void *calloc(size_t a, size_t b) {
    if (!real_calloc) {
        static int resolving;
        if (resolving) {
            void *p = early + used;
            used += (a * b + 15) & ~(size_t)15;
            return p;
        }
        resolving = 1;
        real_calloc = dlsym(RTLD_NEXT, "calloc");
        resolving = 0;
    }
    void *p = real_calloc(a, b);
    logline("malloc", a * b, p, NULL);
    return p;
}

void *realloc(void *q, size_t n) {
    if (!real_realloc) real_realloc = dlsym(RTLD_NEXT, "realloc");
    void *p = real_realloc(q, n);
    logline("realloc", n, p, q);
    return p;
}

int posix_memalign(void **pp, size_t align, size_t n) {
    if (!real_posix_memalign) real_posix_memalign = dlsym(RTLD_NEXT, "posix_memalign");
    int r = real_posix_memalign(pp, align, n);
    if (r == 0) logline("memalign", n, *pp, (void *)align);
    return r;
}

void free(void *p) {
    if (!real_free) real_free = dlsym(RTLD_NEXT, "free");
    if ((char *)p >= early && (char *)p < early + sizeof early) return;
    if (p) logline("free", 0, p, NULL);
    real_free(p);
}
