"""The serve command's own process settings."""

from __future__ import annotations

import gc

from runtime.serve_cli import GC_YOUNG_THRESHOLD, _tune_collector


def test_the_server_freezes_what_it_made_to_start_and_collects_the_young_less_often() -> None:
    threshold = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    try:
        _tune_collector()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, 10, 10)
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
