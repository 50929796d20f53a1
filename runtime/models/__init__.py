"""Model clients over httpx. They store nothing: every call carries the whole transcript.

``open_model_client(ModelConfig(...))`` gives a ModelClient for any OpenAI-compatible server
(Ollama by default). Requests are built from ``persistence.transcript.Message`` values and
``ToolSpec``s; answers come back as a ``Completion`` or as a stream of deltas. Errors are the
``ModelError`` tree in ``runtime.models.errors``.
"""

from runtime.models.client import ChatStream, ModelClient, open_model_client
from runtime.models.endpoint import DEFAULT_BASE_URL, DEFAULT_MODEL, ModelConfig, url_credentials, without_credentials
from runtime.models.errors import (
    ModelBadResponse,
    ModelError,
    ModelRateLimited,
    ModelReasoningRunaway,
    ModelRejected,
    ModelTimeout,
    ModelUnavailable,
)
from runtime.models.values import (
    ChatRequest,
    Completion,
    Delta,
    Finish,
    TextDelta,
    ToolCallDelta,
    ToolSpec,
    Usage,
)
from runtime.models.wire import request_body, unicode_text

__all__ = [
    "DEFAULT_BASE_URL",
    "DEFAULT_MODEL",
    "ChatRequest",
    "ChatStream",
    "Completion",
    "Delta",
    "Finish",
    "ModelBadResponse",
    "ModelClient",
    "ModelConfig",
    "ModelError",
    "ModelRateLimited",
    "ModelReasoningRunaway",
    "ModelRejected",
    "ModelTimeout",
    "ModelUnavailable",
    "TextDelta",
    "ToolCallDelta",
    "ToolSpec",
    "Usage",
    "open_model_client",
    "request_body",
    "unicode_text",
    "url_credentials",
    "without_credentials",
]
