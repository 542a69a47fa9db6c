"""The memory estimator: trace (or formulas) -> per-device breakdown, fit, largest batch."""

from advisor.estimate.estimator import estimate_memory
from advisor.estimate.model import Breakdown, EstimateOptions, EstimateRequest, MemoryEstimate

__all__ = ["Breakdown", "EstimateOptions", "EstimateRequest", "MemoryEstimate", "estimate_memory"]
