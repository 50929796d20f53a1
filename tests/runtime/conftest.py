"""Fixtures for the runtime tests: Keel served on loopback (see tests/runtime/served.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from fake_model import FakeModel

from tests.runtime.served import Served, serve_keel


@pytest.fixture
async def keel(fake_model: FakeModel, tmp_path: Path) -> AsyncIterator[Served]:
    """Stores under ``tmp_path/state``, the runner, and the app on hypercorn, ready to serve."""
    async with serve_keel(tmp_path / "state", fake_model) as served:
        yield served
