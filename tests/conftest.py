"""Fixtures shared by the whole suite."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import trio

# scripts/dev holds developer tools that are not part of the distribution (nothing installs
# them), so it is put on the import path here, once, for the test doubles that live there.
# Appended rather than prepended, so that nothing in it can shadow an installed package.
DEV_SCRIPTS = str(Path(__file__).resolve().parent.parent / "scripts" / "dev")
if DEV_SCRIPTS not in sys.path:
    sys.path.append(DEV_SCRIPTS)

from fake_model import FakeModel  # noqa: E402  (importable only once DEV_SCRIPTS is on the path)


@pytest.fixture
async def fake_model(nursery: trio.Nursery) -> FakeModel:
    """A fake OpenAI-compatible model server on loopback with an empty script; set ``.script``.

    It runs in pytest-trio's ``nursery`` fixture, so it stops when the test ends.
    """
    server: FakeModel = await nursery.start(FakeModel().serve)
    return server
