"""``holding``: a trio.Lock taken at once when it is free, waited for in turn when it is not."""

from __future__ import annotations

import trio

from persistence.locks import holding


class _StepsOf(trio.abc.Instrument):
    """Counts the steps the scheduler runs of one task: a pass through the scheduler is one more."""

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.steps += 1


async def test_a_free_lock_is_taken_without_a_pass_through_the_scheduler() -> None:
    lock = trio.Lock()
    steps = _StepsOf(trio.lowlevel.current_task())
    trio.lowlevel.add_instrument(steps)
    try:
        async with holding(lock):
            assert lock.locked()
        async with lock:  # what trio.Lock costs, for the instrument to show it can see it
            pass
    finally:
        trio.lowlevel.remove_instrument(steps)
    assert steps.steps == 1
    assert not lock.locked()


async def test_a_caller_whose_scope_is_cancelled_is_stopped_at_a_free_lock_and_holds_nothing() -> None:
    lock = trio.Lock()
    entered = False
    with trio.CancelScope() as scope:
        scope.cancel()
        async with holding(lock):
            entered = True
    assert scope.cancelled_caught
    assert not entered
    assert not lock.locked()


async def test_a_held_lock_is_waited_for_and_taken_in_the_order_asked() -> None:
    lock = trio.Lock()
    order: list[int] = []

    async def take(n: int) -> None:
        async with holding(lock):
            order.append(n)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            async with holding(lock):
                for n in range(3):
                    nursery.start_soon(take, n)
                    await trio.testing.wait_all_tasks_blocked()  # each queues behind the one before
                assert order == []
    assert order == [0, 1, 2]
    assert not lock.locked()
