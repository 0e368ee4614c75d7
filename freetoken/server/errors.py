"""API errors, rendered in the shape of the protocol the caller speaks.

Handlers raise `APIError`; the app turns it into the OpenAI shape (`{"error": {"message", "type", "param",
"code"}}`) or the Anthropic one (`{"type": "error", "error": {"type", "message"}}`) by the request's route. The
wording of context-length errors is the one agents match on to trigger their own compaction.
"""

from __future__ import annotations

from dataclasses import dataclass

# status → (OpenAI error type, Anthropic error type)
_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    403: ("permission_error", "permission_error"),
    404: ("not_found_error", "not_found_error"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
    503: ("server_error", "overloaded_error"),
}


@dataclass
class APIError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def openai_body(self) -> dict:
        kind = _TYPES.get(self.status, _TYPES[500])[0]
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        kind = _TYPES.get(self.status, _TYPES[500])[1]
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def context_exceeded_openai(prompt_tokens: int, limit: int) -> APIError:
    return APIError(400, f"This model's maximum context length is {limit} tokens. However, your messages "
                         f"resulted in {prompt_tokens} tokens. Please reduce the length of the messages.",
                    param="messages", code="context_length_exceeded")


def context_exceeded_anthropic(prompt_tokens: int, limit: int) -> APIError:
    return APIError(400, f"prompt is too long: {prompt_tokens} tokens > {limit - 1} maximum",
                     code="context_length_exceeded")


def stream_error(e: Exception) -> APIError:
    """An error met after a stream began, as the APIError its protocol's error event carries."""
    if isinstance(e, APIError):
        return e
    from freetoken.engine.batching import KVCacheFull
    from freetoken.server.engine import Saturated

    if isinstance(e, Saturated | KVCacheFull):
        return APIError(503, str(e))
    return APIError(500, f"generation failed: {e}")
