"""The agent loop's errors.

AgentError
├── BudgetExhausted   the turn made as many model calls as it may
├── MaxStepsReached   the model was still calling tools after max_steps requests
├── AnswerTruncated   the model's answer was cut off at its length limit
├── AnswerTooLarge    the model's answer grew past what one message of a transcript may hold
├── AnswerFiltered    the model's provider withheld its answer (a content filter)
├── AnswerFailed      the model's server ended its answer with an error
├── AnswerEmpty       the model's answer held no text and called no tool
├── SaveFailed        the session could not be written or its steers taken (its storage may be damaged)
└── RunFinished       a steer for a run that has ended

Their messages are safe to show an A2A client: they name the session (as A2A calls it, the
context) and the limit, never a store's own words (which may hold file paths); those stay in
``__cause__`` for the logs.
"""

from __future__ import annotations


class AgentError(Exception):
    pass


class BudgetExhausted(AgentError):
    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__(
            f"model call budget exhausted: the turn made its {limit} model calls with the model still working; "
            "raise the limit (AGENT_MAX_MODEL_CALLS) or ask for less in one turn"
        )


class MaxStepsReached(AgentError):
    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps
        super().__init__(f"the run hit max_steps ({max_steps}) with the model still calling tools")


class AnswerTruncated(AgentError):
    def __init__(self) -> None:
        super().__init__(
            "the model's answer was cut off at its length limit before it finished (finish_reason 'length'); "
            "ask for a shorter answer, or raise the model's output limit"
        )


class AnswerTooLarge(AgentError):
    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__(
            f"the model's answer grew past {limit} bytes, the most one message of a conversation may hold, "
            "and was cut off there; ask for a shorter answer, or give the model a lower output limit"
        )


class AnswerFiltered(AgentError):
    def __init__(self) -> None:
        super().__init__(
            "the model's answer was withheld by its provider's content filter (finish_reason 'content_filter'); "
            "rephrase the request"
        )


class AnswerFailed(AgentError):
    def __init__(self, finish_reason: str) -> None:
        self.finish_reason = finish_reason
        super().__init__(
            f"the model's server ended the answer with an error (finish_reason {finish_reason!r}) before it was complete; "
            "send the message again, with a new messageId"
        )


class AnswerEmpty(AgentError):
    def __init__(self) -> None:
        super().__init__(
            "the model's answer held no text (nothing, only white space, or only its reasoning) and called no tool; "
            "send the message again, with a new messageId"
        )


# What a client whose run failed on the server's storage is told to do: the storage failed (a full
# disk, say), which passes; or it is damaged, which stays so until its operator restores it.
SEND_AGAIN_WHEN_BACK = "send the message again, with a new messageId, once the server's storage is back"
UNTIL_RESTORED = "until the server's operator restores the storage (the server log says how)"


class SaveFailed(AgentError):
    """``what`` is the action that failed ("saving the transcript", ...); ``before_model`` says
    whether the run stopped before its next model request (false for the save at the end);
    ``conflict``, how the transcript the run was given differs from the stored one (a
    TranscriptConflict's reason), when that is why."""

    def __init__(
        self, session_id: str, what: str, *, before_model: bool = True, damaged: bool = False, conflict: str = ""
    ) -> None:
        self.session_id = session_id
        # Said to the client of the task that fails with it: its context is the session, and the
        # task's end, which it reads, is stored all the same.
        outcome = "so the run stopped before calling the model" if before_model else "so the conversation does not hold it"
        if conflict:  # nothing failed: the run was given a transcript other than the one stored
            super().__init__(
                f"{what} for session {session_id!r} failed, {outcome}: the transcript the run was given does not extend"
                f" the one stored ({conflict}); give the run the session's stored messages (Session.messages()),"
                " then the new ones"
            )
        elif damaged:  # no outage that passes: the storage stays so until it is restored
            super().__init__(
                f"{what} for context {session_id!r} failed: the server's storage is damaged where it is kept, {outcome};"
                f" its turns fail so {UNTIL_RESTORED}"
            )
        else:
            super().__init__(f"{what} for context {session_id!r} failed, {outcome}; {SEND_AGAIN_WHEN_BACK}")


class RunFinished(AgentError):
    def __init__(self) -> None:
        super().__init__("the run has finished, so there is no request left to carry a steer; send a new message instead")
