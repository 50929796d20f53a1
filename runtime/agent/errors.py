"""The agent loop's errors.

AgentError
├── BudgetExhausted   the turn made as many model calls as it may
├── MaxStepsReached   the model was still calling tools after max_steps requests
├── SaveFailed        the transcript could not be stored; the model was not called
└── RunFinished       a steer for a run that has ended
"""

from __future__ import annotations


class AgentError(Exception):
    pass


class BudgetExhausted(AgentError):
    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__(
            f"the turn exhausted its budget of {limit} model calls with the model still working; "
            "raise the limit (AGENT_MAX_MODEL_CALLS) or ask for less in one turn"
        )


class MaxStepsReached(AgentError):
    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps
        super().__init__(f"the run hit max_steps ({max_steps}) with the model still calling tools")


class SaveFailed(AgentError):
    def __init__(self, session_id: str, what: str) -> None:
        self.session_id = session_id
        super().__init__(f"{what} for session {session_id!r} failed, so the run stopped before calling the model")


class RunFinished(AgentError):
    def __init__(self) -> None:
        super().__init__("the run has finished, so there is no request left to carry a steer; send a new message instead")
