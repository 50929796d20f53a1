"""A message sent again (the same messageId): told from a mistake, and recorded once."""

from __future__ import annotations

import json

import attrs

from persistence.api import SteerReceipt
from protocol import InvalidParams, Message, Task
from protocol.errors import quoted
from runtime.tasks import STORED_VERSION


def check_same(message: Message, sent: Message, task: Task, where: str) -> Task:
    """``task``, which ``sent`` went to, if ``message`` (of the same id) says the same."""
    # Compared as stored, so that what storing normalises (an empty metadata, say) does not make
    # the same message look like another; and as JSON text, which tells true from 1 (== does not).
    if as_sent(message) != as_sent(sent):
        raise sent_with_other_content(message, where)
    return task


def with_message(task: Task, message: Message) -> Task:
    """``task`` with ``message`` last in its history, unless it is there already (the same
    message sent twice at once: both sends record it, once)."""
    if any(taken.message_id == message.message_id for taken in task.history):
        return task
    return attrs.evolve(task, history=(*task.history, message))


def as_sent(message: Message) -> str:
    """A message's parts as stored: what tells the same message sent again from another."""
    return json.dumps([part.to_json(STORED_VERSION) for part in message.parts], sort_keys=True, separators=(",", ":"))


def check_receipt(receipt: SteerReceipt, message: Message, task_id: str) -> None:
    """A message whose id a steer was left with is that steer sent again, or a mistake said as such."""
    if receipt.task_id is not None and receipt.task_id != task_id:
        raise InvalidParams(
            "message.messageId",
            problem=f"{quoted(message.message_id)} was sent before, to task {receipt.task_id!r}; a new message needs a new messageId",
        )
    if not receipt.same(as_sent(message)):
        raise sent_with_other_content(message, f"went to task {task_id!r}")


def sent_with_other_content(message: Message, where: str) -> InvalidParams:
    return InvalidParams(
        "message.messageId",
        problem=f"{quoted(message.message_id)} was sent before with other content, and {where}; a new message needs a new messageId",
    )
