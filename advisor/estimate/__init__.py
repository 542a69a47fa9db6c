"""The memory estimator: trace (or formulas) -> per-device breakdown, fit, largest batch."""

from advisor.estimate.estimator import estimate_memory
from advisor.estimate.model import Breakdown, EstimateRequest, MemoryEstimate

__all__ = ["Breakdown", "EstimateRequest", "MemoryEstimate", "estimate_memory"]
