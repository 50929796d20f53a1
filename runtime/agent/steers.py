"""The in-memory half of steering: steers handed to a run while it holds no request."""

from __future__ import annotations

import attrs

from persistence.transcript import Message
from runtime.agent.errors import RunFinished

STEER_LABEL = "The user sent this while you were working:\n"
# A user message sent to the model right after a steer (the turn the steer rode ended with no
# answer): the two go as one message, and without this the question would read as more of the steer.
NEXT_LABEL = "The user's next message:\n"


def is_steer(message: Message) -> bool:
    """Whether a transcript's message is a steer: a user message with the label, naming no turn.
    A question the runner stores names the turn it opens (``turn_id``), so one that happens to
    begin with the label's words is still read as a question; a caller of AgentRun that gives
    its questions no turn id reads such a question as a steer."""
    return message.role == "user" and not message.turn_id and message.text.startswith(STEER_LABEL)


def labelled_after_steers(messages: list[Message]) -> list[Message]:
    """``messages`` with each user message that directly follows a steer, and is not one itself,
    labelled as the user's next message."""
    return [
        attrs.evolve(message, text=NEXT_LABEL + message.text)
        if message.role == "user" and not is_steer(message) and index and is_steer(messages[index - 1])
        else message
        for index, message in enumerate(messages)
    ]


def steer_message(text: str) -> Message:
    """A steer as the transcript keeps it: a user message, labelled as sent while the agent worked."""
    return Message(role="user", text=STEER_LABEL + text)


@attrs.define(eq=False)
class SteerBox:
    """Steers given to a run with ``Run.steer``, each taken exactly once.

    Once closed (the run has ended) a new steer is refused with RunFinished, and what was never
    taken is handed back by ``close()``.
    """

    _pending: list[str] = attrs.field(init=False, factory=list)
    _closed: bool = attrs.field(init=False, default=False)

    def add(self, text: str) -> None:
        if self._closed:
            raise RunFinished()
        if not isinstance(text, str) or not text.strip():
            raise ValueError("a steer must be non-empty text")
        self._pending.append(text)

    def take(self) -> list[str]:
        taken, self._pending = self._pending, []
        return taken

    def __bool__(self) -> bool:
        return bool(self._pending)

    def close(self) -> list[str]:
        self._closed = True
        return self.take()
