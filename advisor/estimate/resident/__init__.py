"""The CPU resident-set model: calibration runs, the glibc heap log and its replay, their cache."""
