"""Error types that reach users.

Every error raised on purpose by freetoken derives from `FreeTokenError`. Its message is one line that names
the problem and, where there is one, the fix; the CLI prints it as is and exits non-zero, the server maps it
to a 4xx in the caller's protocol.
"""

from __future__ import annotations


class FreeTokenError(Exception):
    """Base of every error freetoken raises on purpose."""


class ModelLoadError(FreeTokenError):
    """A model source is missing, truncated or malformed."""


class UnsupportedArchitectureError(ModelLoadError):
    """The checkpoint's architecture has no model family here."""


class GGUFError(ModelLoadError):
    """A GGUF file is malformed: bad magic, bad header, truncated tensors, unknown types."""


class TokenizerError(FreeTokenError):
    """Tokenizer files or GGUF vocabulary metadata are missing or malformed."""


class ChatTemplateError(FreeTokenError):
    """A chat template is missing, fails to render, or tries to escape the sandbox."""


class ModelSourceError(ModelLoadError):
    """A model name cannot be resolved to local files (unknown repo id offline, no registry for the default)."""
