"""Targets shared by the search-space tests: catalog hardware only, so results do not depend on
the machine the tests run on."""

from __future__ import annotations

import pytest

from advisor.hardware import get_hardware
from search_spaces import SpaceContext


@pytest.fixture(scope="session")
def cpu():
    return get_hardware("cpu:1")


@pytest.fixture(scope="session")
def gpus8():
    return get_hardware("h100-sxm:8")


@pytest.fixture(scope="session")
def cpu_ctx(cpu):
    return SpaceContext(hardware=cpu, device_count=1, default_batch_size=8)


@pytest.fixture(scope="session")
def gpu_ctx(gpus8):
    return SpaceContext(hardware=gpus8, device_count=8, default_batch_size=8)
