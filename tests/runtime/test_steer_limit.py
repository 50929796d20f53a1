"""How many steers one task takes: a bounded number, so that one client cannot grow a task (stored
whole at every steer, and sent whole to every reader) without end. Keel served on loopback."""

from __future__ import annotations

import trio
from fake_model import Reply

from runtime.runner import ANONYMOUS
from tests.runtime.served import DEADLINE_S, GATE_CALL, Served, message

SENT_AT_MOST = 200  # far more than a task takes: past it, nothing bounds the task


async def test_a_task_takes_a_bounded_number_of_steers_and_refuses_more_saying_what_to_do(keel: Served) -> None:
    keel.model.script = [Reply(tool_calls=[GATE_CALL]), Reply(text="Done.")]
    task = await keel.send("Restart the worker", blocking=False)
    await keel.gate.wait_entered()
    steer = {"configuration": {"returnImmediately": True, "historyLength": 0}}
    taken = 0
    refused = None
    while refused is None and taken < SENT_AT_MOST:
        answer = (await keel.call("SendMessage", {"message": message(f"steer {taken}", taskId=task["id"]), **steer})).json()
        if "error" in answer:
            refused = answer["error"]
        else:
            taken += 1
    assert refused is not None, f"{taken} steers were all taken"
    assert refused["code"] == -32004, refused
    assert task["id"] in refused["message"] and f"{taken} messages" in refused["message"], refused
    assert "without a taskId" in refused["message"], refused

    keel.gate.opened.set()
    with trio.fail_after(DEADLINE_S):
        await keel.runner.wait_settled(ANONYMOUS, task["id"])
    done = await keel.result("GetTask", {"id": task["id"]})
    assert done["status"]["state"] == "TASK_STATE_COMPLETED"
    assert len(done["history"]) == 1 + taken + 1  # the question, every steer taken, the answer
    asked = "\n".join(str(item.get("content")) for item in keel.model.bodies[-1]["messages"])
    assert f"steer {taken - 1}" in asked and f"steer {taken}" not in asked
