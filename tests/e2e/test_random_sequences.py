"""Random sequences of what clients do, against a real server stopped and killed between them:
what each client was told stands (see random_clients)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fake_model import FakeModel
from tests.e2e.random_clients import Driver, reply_for

SEEDS = [1, 2, 3, 4]
ACTIONS = 30


@pytest.mark.parametrize("seed", SEEDS)
async def test_a_random_sequence_of_client_actions_and_restarts_keeps_what_each_client_was_told(
    tmp_path: Path, fake_model: FakeModel, seed: int
) -> None:
    fake_model.respond = reply_for
    await Driver(tmp_path / "state", fake_model, seed).run(ACTIONS)
