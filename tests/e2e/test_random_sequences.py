"""Random sequences of what clients do, against a real server stopped and killed between them:
what each client was told stands (see random_clients)."""

from __future__ import annotations

import signal
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import trio

from fake_model import FakeModel, Reply
from tests.e2e.random_clients import ANSWER, Driver, Violation, reply_for

SEEDS = [1, 2, 3, 4]
ACTIONS = 30


@pytest.mark.parametrize("seed", SEEDS)
async def test_a_random_sequence_of_client_actions_and_restarts_keeps_what_each_client_was_told(
    tmp_path: Path, fake_model: FakeModel, seed: int
) -> None:
    fake_model.respond = reply_for
    await Driver(tmp_path / "state", fake_model, seed).run(ACTIONS)


async def test_a_client_that_never_waits_for_what_is_still_to_come_holds_to_the_same_checks(
    tmp_path: Path, fake_model: FakeModel
) -> None:
    # As a machine too busy to send a stream's first event, or a blocking send's answer, within
    # the time a client waits for more: a sequence's checks do not depend on how fast it is.
    fake_model.respond = reply_for
    await Driver(tmp_path / "state", fake_model, seed=5, wait_s=0).run(ACTIONS)


async def test_a_model_request_cut_short_by_a_kill_is_not_one_the_model_saw(fake_model: FakeModel, tmp_path: Path) -> None:
    # A server killed as it sends a model request leaves the model half a body, which it cannot read.
    url = urlsplit(fake_model.base_url)
    assert url.hostname is not None and url.port is not None
    stream = await trio.open_tcp_stream(url.hostname, url.port)
    head = f"POST /v1/chat/completions HTTP/1.1\r\nhost: {url.netloc}\r\ncontent-type: application/json\r\n"
    await stream.send_all(f"{head}content-length: 400\r\n\r\n".encode() + b'{"model": "qwen3:4b-instruct", "messages": [{"ro')
    await stream.aclose()
    with trio.fail_after(10):
        while not fake_model.bodies:
            await trio.sleep(0.01)  # polling against the deadline
    assert fake_model.bodies == [None]
    Driver(tmp_path / "state", fake_model, seed=0).check_model()


async def test_a_steer_sent_again_that_the_server_refuses_fails_the_sequence(tmp_path: Path, fake_model: FakeModel) -> None:
    fake_model.respond = reply_for
    driver = Driver(tmp_path / "state", fake_model, seed=0)
    async with driver.serving():
        await driver.deliver(driver.message("question 1 mode=fast", "1.0"), "1.0", "immediate")
        (known,) = driver.tasks.values()
        await driver.settle()
        # Told taken, as far as the clients know; the server never saw it, and refuses it for a task that has ended.
        steer = driver.message("steer 2 mode=fast", "1.0", task_id=known.id)
        known.steers.append((steer, "1.0"))
        with pytest.raises(Violation, match=f"resent steer {steer['messageId']} refused"):
            await driver.resend_steer(known, steer, "1.0")


async def test_a_send_refused_as_the_server_shuts_down_is_sent_again_to_the_next(tmp_path: Path, fake_model: FakeModel) -> None:
    # The server says to send it again once the server that replaces it is up: a task it could not
    # confirm may land yet, and is the clients' then.
    fake_model.respond = reply_for
    driver = Driver(tmp_path / "state", fake_model, seed=0, model_timeout_s=60, drain_timeout_s=60)
    async with driver.serving():
        await driver.deliver(driver.message("question 1 mode=hang", "1.0"), "1.0", "immediate")  # the drain waits for it
        assert driver.keel is not None
        driver.keel.process.send_signal(signal.SIGTERM)
        with trio.fail_after(10):
            while b"shutting down" not in driver.keel.output:
                await trio.sleep(0.01)  # polling the output against the deadline
        refused = driver.message("question 2 mode=fast", "1.0")
        await driver.deliver(refused, "1.0", "immediate")
        assert driver.unanswered == [(refused, "1.0")]
        fake_model.respond = lambda body: Reply(text=ANSWER)  # the task resumed, answered at once
        await driver.stop("kill")
        await driver.start()
    assert [known.first for known in driver.tasks.values()][1:] == [refused]
