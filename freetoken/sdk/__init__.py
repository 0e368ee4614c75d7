"""The Session SDK: `Engine.load(...)` in-process, `connect(url)` against a running `ft serve`; both give
sessions with `send`, `fork`, `checkpoint`, `rollback` and `edit`."""

from freetoken.sdk.local import Engine, Session
from freetoken.sdk.remote import RemoteEngine, RemoteSession, connect
from freetoken.sdk.reply import Reply, ReplyStats
from freetoken.server.output import ToolCall  # what `Reply.tool_calls` holds: .name, .arguments (a dict)

__all__ = ["Engine", "RemoteEngine", "RemoteSession", "Reply", "ReplyStats", "Session", "ToolCall", "connect"]
