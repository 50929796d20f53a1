"""The model client's errors. Each names the model it is about.

ModelError
├── ModelUnavailable   the server could not be reached, the connection broke, it kept answering 5xx, or it
│                      reported an error in the middle of its answer
├── ModelRateLimited   the server kept answering HTTP 429
├── ModelTimeout       nothing arrived within the connect or read timeout
├── ModelRejected      the server refused this request (HTTP 4xx other than 429): bad request, key, model
├── ModelBadResponse   the server answered 2xx with something that is not a chat completion
└── ModelReasoningRunaway  the model reasoned past any answer one message may hold, and had not started it

``str(error)`` is safe to show an A2A client: it is built from the model name, the HTTP status and
this module's own words, never from the API key, the server's URL or what the server said. Its
last part, why the call failed, is ``error.reason`` (without the model's name or the attempts),
for whatever else must say why in the same words (a readiness problem). What the server or the
transport said is in ``error.detail``, for logs only.
"""

from __future__ import annotations

# The meaning of the 4xx answers an OpenAI-compatible server gives, in words safe for a client.
_REJECTIONS = {
    400: "the request is malformed or does not fit the model",
    401: "the API key was refused",
    403: "the API key may not use this model",
    404: "the model or the endpoint does not exist on the server",
    408: "the server gave up waiting for the request",
    413: "the request is too large",
    422: "the request is malformed or does not fit the model",
}


class ModelError(Exception):
    """Base class for every error the model client raises.

    Attributes: ``model`` (the configured model name), ``reason`` (why, in this module's words:
    safe for a client), ``detail`` (what the server or the transport said; may hold provider
    text, so log it but never send it to a client), ``status`` (the HTTP status, when there was
    one), ``attempts`` (how many requests were sent) and ``retryable`` (whether the client would
    have tried again, given attempts left: the server could not be reached, was overloaded or
    rate limiting; a caller that can wait longer than its retries may try again later) and
    ``may_pass`` (whether what failed is the server's state of the moment, down, overloaded or
    failing one answer, so that the same request sent later may be answered: not a refusal, an
    answer that cannot be read, or a setting to change).
    """

    retryable = False  # set by runtime.models.failures, which decides it
    may_pass = False

    def __init__(
        self, model: str, headline: str, reason: str, *, detail: str = "", status: int | None = None, attempts: int = 1
    ) -> None:
        super().__init__(f"model {model!r} {headline}: {reason}{_after(attempts)}")
        self.model = model
        self.reason = reason
        self.detail = detail
        self.status = status
        self.attempts = attempts


def _after(attempts: int) -> str:
    return f" (gave up after {attempts} attempts)" if attempts > 1 else ""


class ModelUnavailable(ModelError):
    def __init__(
        self, model: str, reason: str, *, detail: str = "", status: int | None = None, attempts: int = 1, may_pass: bool = True
    ) -> None:
        """``may_pass``: false where a setting is to change (TLS, say), not the server's state."""
        super().__init__(model, "is unavailable", reason, detail=detail, status=status, attempts=attempts)
        self.may_pass = may_pass


class ModelRateLimited(ModelError):
    may_pass = True

    def __init__(self, model: str, *, retry_after_s: float | None = None, detail: str = "", attempts: int = 1) -> None:
        wait = f"; it asked to wait {retry_after_s:g}s before trying again" if retry_after_s is not None else ""
        reason = f"the server answered HTTP 429{wait}"
        super().__init__(model, "is rate limited", reason, detail=detail, status=429, attempts=attempts)
        self.retry_after_s = retry_after_s


class ModelTimeout(ModelError):
    may_pass = True

    def __init__(self, model: str, waiting_for: str | None, timeout_s: float, *, detail: str = "", attempts: int = 1) -> None:
        """``waiting_for``: what did not come once the server had the connection; None: the
        connection itself (``connecting``), which was never made."""
        if waiting_for is None:
            reason = f"no connection to the model server was made within {timeout_s:g}s"
        else:
            reason = f"nothing arrived within {timeout_s:g}s while waiting for {waiting_for}"
        super().__init__(model, "timed out", reason, detail=detail, attempts=attempts)
        self.timeout_s = timeout_s
        self.connecting = waiting_for is None


# A refusal of who asks, when that is not an API key: the base URL's credentials, or nothing.
_WHO_ASKS = {
    (401, "the credentials in the base URL"): "the credentials in the base URL were refused",
    (403, "the credentials in the base URL"): "the credentials in the base URL may not use this model",
    (401, None): "the server wants an API key, and none was given",
    (403, None): "the server does not let a request without an API key use this model",
}


class ModelRejected(ModelError):
    def __init__(
        self, model: str, status: int, *, detail: str = "", attempts: int = 1, sent: str | None = "the API key", hint: str = "",
        meaning: str | None = None,
    ) -> None:  # fmt: skip
        """``sent``: what the request carried to say who asks (the API key, or the base URL's
        credentials), or None when it carried nothing. ``hint``: what may be wrong, to follow.
        ``meaning``: why, where the server's answer told more than its status."""
        meaning = meaning or _REJECTIONS.get(status, "the server refused the request")
        if status in (401, 403) and sent != "the API key":
            meaning = _WHO_ASKS[status, sent]
        reason = f"{meaning} (HTTP {status}){hint}"
        super().__init__(model, "rejected the request", reason, detail=detail, status=status, attempts=attempts)


class ModelBadResponse(ModelError):
    def __init__(self, model: str, reason: str, *, detail: str = "", status: int | None = None, attempts: int = 1) -> None:
        super().__init__(model, "sent an answer that could not be read", reason, detail=detail, status=status, attempts=attempts)


class ModelReasoningRunaway(ModelError):
    """A model that reasoned for more than ``limit`` characters in one answer (``started``: after
    some of it had come): a small one can go round in its reasoning for ever, never silent for
    long enough to time out."""

    def __init__(self, model: str, limit: int, *, started: bool = False) -> None:
        where = "in one answer" if started else "and had not started its answer"
        reason = f"it reasoned for more than {limit} characters {where}"
        super().__init__(model, "would not stop reasoning", f"{reason}; ask again, or for less in one message")
        self.limit = limit
