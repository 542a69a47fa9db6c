"""glibc's mmap threshold between the runs and the batch: where they lie across it, and runs that stand in."""

from __future__ import annotations

from advisor.estimate.batchmodel import BatchModel
from advisor.estimate.model import EstimateRequest
from advisor.estimate.resident.calibration import Run
from advisor.estimate.resident.terms import MMAP_FROM_BYTES, batch_terms, mmap_from
from advisor.procmem import MMAP_THRESHOLD_MAX

# glibc's initial mmap threshold (DEFAULT_MMAP_THRESHOLD_MIN): no run fixes one lower.
MMAP_THRESHOLD_MIN = 128 * 1024
# The share of a target's transient peak in mapped allocations from which a crossing is worth a warning.
MAPPED_REGIME_SHARE = 0.25


def run_mmap_threshold(b: int, target: int) -> int | None:
    """glibc's mmap threshold for a resident-set run at batch b that stands in for batch `target`
    (bytes), or None (glibc's dynamic default) where b is the target or more. glibc maps a request
    of 32 MiB and up on its own and unmaps it when freed, but serves smaller ones from its heap once
    its dynamic threshold has risen past them, and a freed heap chunk stays resident. A tensor that
    grows with the batch is b/target of its size at the target in the run, so the run's threshold is
    b/target of 32 MiB: what the target maps, the run maps.
    Evidence: bench/research/threshold_policy.py, bench/results/archive/threshold_policy.json"""
    if b >= target:
        return None
    return max(MMAP_THRESHOLD_MIN, MMAP_THRESHOLD_MAX * b // target)


def threshold_target(req: EstimateRequest, bm: BatchModel, batches, target: int) -> int | None:
    """`target` where runs at `batches` under glibc's default would lie across its mmap threshold
    from it (`crosses`), so their thresholds scale to it; else None: they run as a user runs them. A
    lowered threshold also maps what does not grow with the batch (dlrm's 24 MiB embedding tables'
    optimizer temporaries, heap-served at b2048, mapped in runs at 256-1024), so it is lowered only
    where the batch needs it.
    Evidence: bench/research/threshold_policy.py, bench/results/archive/threshold_policy.json"""
    return target if crosses(req, bm, tuple((b, 0, None) for b in batches), target) else None


def mapped_share(req: EstimateRequest, bm: BatchModel, b: int, mapped_from: int = MMAP_FROM_BYTES) -> float:
    """The share of batch b's transient peak held by allocations glibc maps on their own (0-1), for
    a glibc that maps requests from `mapped_from` bytes up."""
    _, heap, mapped, _, _ = batch_terms(req, bm, b, mapped_from)
    return mapped / (heap + mapped) if heap + mapped > 0 else 0.0


def _shares(req: EstimateRequest, bm: BatchModel, runs: tuple[Run, ...], b: int) -> tuple[float, list[float]] | None:
    """(batch b's mapped share under glibc's default, each run's under its own threshold), or None where
    b maps under MAPPED_REGIME_SHARE: then no run lies across the threshold from it."""
    share = mapped_share(req, bm, b)
    if share < MAPPED_REGIME_SHARE:
        return None
    return share, [mapped_share(req, bm, x, mmap_from(t)) for x, _, t in runs]


def _crossing(req: EstimateRequest, bm: BatchModel, runs: tuple[Run, ...], b: int) -> tuple[float, float] | None:
    """(batch b's mapped share under glibc's default, the largest of the runs' under their own thresholds)
    where b lies across glibc's mmap threshold from every run (`crosses`), else None."""
    shares = _shares(req, bm, runs, b) if runs else None
    if shares is None:
        return None
    share, ran = shares[0], max(shares[1])
    return (share, ran) if ran < share / 2 else None


def across_threshold(req: EstimateRequest, bm: BatchModel, points: tuple[Run, ...], b: int) -> tuple[Run, ...]:
    """The runs among `points` (measured peaks) that lie across glibc's mmap threshold from batch b, one
    by one as `crosses` asks of all: b maps at least MAPPED_REGIME_SHARE of its transient peak, the run
    under half that share under its own threshold. Their resident bytes per heap-served byte are the
    heap's regime, not b's."""
    shares = _shares(req, bm, points, b)
    if shares is None:
        return ()
    return tuple(p for p, ran in zip(points, shares[1]) if ran < shares[0] / 2)


def crosses(req: EstimateRequest, bm: BatchModel, runs: tuple[Run, ...], b: int) -> bool:
    """Whether batch b lies across glibc's mmap threshold from every resident-set run: at least
    MAPPED_REGIME_SHARE of its transient peak is mapped, and no run had half its share under its own
    threshold. A freed mapped allocation leaves the resident set and a freed heap chunk stays, so the
    runs' resident bytes per transient byte do not carry over."""
    return _crossing(req, bm, runs, b) is not None


def mapped_regime_note(req: EstimateRequest, bm: BatchModel, runs: tuple[Run, ...], b: int) -> str | None:
    """A warning when batch b lies across glibc's mmap threshold from every resident-set run
    (`Calibration.rss`; `crosses`): nothing the runs show says by how much their resident bytes per
    transient byte stop carrying over (+35% for an mlp whose 32 MiB activations leave a heap fragmented
    2.2x at the runs' batch sizes, -10% for a transformer encoder whose attention maps cross). Calibration
    runs that would cross scale the threshold (`run_mmap_threshold`) and do not; measured peaks at smaller
    batches, run as a user runs them, can."""
    crossing = _crossing(req, bm, runs, b)
    if crossing is None:
        return None
    share, ran = crossing
    return (f"less certain: at batch {b}, {share:.0%} of the transient peak is allocations of 32 MiB and up, which "
            f"glibc maps on their own and unmaps when freed, against at most {ran:.0%} in the runs fitted "
            f"(batch sizes {', '.join(map(str, sorted({x for x, _, _ in runs})))}); the resident set is extrapolated "
            "across glibc's mmap threshold, where errors of -10% to +35% were measured (BENCHMARKS.md)")
