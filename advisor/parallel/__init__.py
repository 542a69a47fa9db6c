"""Parallelism beyond data parallel: a layout (dp x tp x pp) over the devices, applied to a model the same way in
a measured trial over real ranks and in the estimator's trace of one rank under a fake process group."""

from advisor.parallel.layout import Layout, PipelineSchedule, layout_problems

__all__ = ["Layout", "PipelineSchedule", "layout_problems"]
