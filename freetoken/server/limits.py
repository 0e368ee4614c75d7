"""The reply budget a server states for its context: one definition for the server (`/v1/models`
`max_output_tokens`) and for `ft launch` when it configures an agent without a server to ask (a dry run)."""

from __future__ import annotations

MAX_REPLY_BUDGET = 32768


def reply_budget(context: int) -> int:
    """A quarter of the context, so a long conversation still has room for its reply, and at most 32k tokens."""
    return max(1, min(MAX_REPLY_BUDGET, context // 4))
