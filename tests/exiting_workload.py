"""A workload file that exits while it is imported (sys.exit at module level), for the isolation tests."""

import sys

sys.exit(3)


def build():  # never reached
    raise AssertionError("the module exits before build() can be called")
