"""Text <-> token ids for one model, from an HF tokenizer directory or a GGUF file's vocabulary metadata.

Owns `Tokenizer` (encode, decode, special ids, chat template) and `IncrementalDecoder` (streaming text out of
generated ids). The heavy lifting is done by a `tokenizers.Tokenizer` backend: loaded from `tokenizer.json`,
or rebuilt from GGUF metadata by `gguf_vocab`.

Invariants:
- `encode(text)` parses special tokens written in `text` (a rendered chat template relies on that) and adds
  BOS only when `add_special_tokens=True` *and* the model's files ask for it; nothing else is ever added.
- `eos_token_ids` (every id that ends generation) is the union of:
    1. the tokenizer's eos token (`eos_token` in tokenizer_config.json, `tokenizer.ggml.eos_token_id`);
    2. `eos_token_id` of generation_config.json (an int or a list);
    3. `tokenizer.ggml.eot_token_id` / `eom_token_id` when a GGUF states them;
    4. every end-of-turn token llama.cpp recognises by name (`END_OF_TURN_TOKENS`) that the vocabulary
       holds *as a special token*: chat models stop on it even where their files only name the
       document-level eos (SmolLM2's GGUF names `<|im_end|>`, which also gets `<|endoftext|>`).
  `<|end|>` is left out when `<|return|>` and `<|call|>` exist: in that (harmony) format it ends a message,
  not the turn.
- `IncrementalDecoder`: the concatenation of everything `push` and `flush` return equals `decode(ids)`,
  for any ids, valid UTF-8 or not.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from freetoken.engine.call_languages import (
    DEEPSEEK_CALL,
    DEEPSEEK_CALL_END,
    DEEPSEEK_CLOSE,
    DEEPSEEK_OPEN,
    DEEPSEEK_SEP,
    DSML,
)
from freetoken.engine.chat_template import ChatTemplate
from freetoken.engine.gguf_vocab import build_gguf_vocab
from freetoken.engine.token_bytes import TokenBytes
from freetoken.errors import ChatTemplateError, TokenizerError

END_OF_TURN_TOKENS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
)
log = logging.getLogger(__name__)
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


KEPT_MARKERS = frozenset({"<think>", "</think>", "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]",
                          "[CALL_ID]", "<|python_tag|>", DEEPSEEK_OPEN, DEEPSEEK_CLOSE, DEEPSEEK_CALL,
                          DEEPSEEK_CALL_END, DEEPSEEK_SEP, DSML})
# gpt-oss's Harmony message structure (special tokens of its vocabulary): kept where the vocabulary has them
HARMONY_MARKERS = ("<|start|>", "<|end|>", "<|channel|>", "<|message|>", "<|constrain|>")
# Tokens that close a block inside a message — a reasoning block, a tool call (Hermes/Qwen JSON, Qwen3-Coder XML),
# a tool result rendered inline: semantic boundaries for checkpoints where the vocabulary has them as one token.
BLOCK_END_MARKERS = ("</think>", "</tool_call>", "</function>", "</tool_response>")


@dataclass(slots=True, eq=False)
class Tokenizer:
    """A model's tokenizer; build it with `from_hf_dir` or `from_gguf_metadata`."""

    backend: Backend
    bos_token_id: int | None
    eos_token_id: int | None
    eos_token_ids: frozenset[int]
    add_bos_token: bool
    special_ids: frozenset[int]  # ids `decode(skip_special_tokens=True)` drops
    byte_fallback_ids: frozenset[int]  # `<0xNN>` ids of a byte-fallback vocabulary; empty for byte-level BPE
    chat_template: ChatTemplate | None = None
    tool_use_template: ChatTemplate | None = None  # HF's named "tool_use" template, preferred when tools are given
    # Why the model's template did not compile: the tokenizer still loads (raw prompts need no template),
    # and `apply_chat_template` reports this.
    chat_template_error: str | None = None
    _token_bytes: TokenBytes | None = field(default=None, init=False, repr=False)  # made on first use

    # ---- construction ---------------------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """From the metadata dict of a GGUF file (`tokenizer.ggml.*`, `tokenizer.chat_template`)."""
        vocab = build_gguf_vocab(metadata)
        eos_ids = {*_optional(vocab.eos_token_id), *vocab.end_of_turn_ids}
        return cls._assemble(
            vocab.backend,
            bos_id=vocab.bos_token_id,
            eos_id=vocab.eos_token_id,
            extra_eos=eos_ids,
            add_bos=vocab.add_bos,
            templates={
                "default": metadata.get("tokenizer.chat_template"),
                "tool_use": metadata.get("tokenizer.chat_template.tool_use"),  # llama.cpp's name for HF's
            },
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """From an HF model directory: tokenizer.json plus the optional tokenizer_config.json,
        chat_template.jinja / chat_template.json and generation_config.json."""
        root = Path(path)
        spec = root / "tokenizer.json"
        if not spec.is_file():
            raise TokenizerError(
                f"{spec} not found: freetoken needs the fast tokenizer file; download it with the model, or "
                "create it with transformers (AutoTokenizer.from_pretrained(dir).save_pretrained(dir))"
            )
        try:
            backend = Backend.from_file(str(spec))
        except Exception as exc:
            raise TokenizerError(f"{spec} could not be loaded: {' '.join(str(exc).split())}") from None
        config = _read_json(root / "tokenizer_config.json")
        generation = _read_json(root / "generation_config.json")
        bos_id = _token_id_of(backend, config.get("bos_token"))
        eos_id = _token_id_of(backend, config.get("eos_token"))
        gen_eos = generation.get("eos_token_id")
        gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        extra_eos = {*_optional(eos_id), *(i for i in gen_eos if isinstance(i, int))}
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            # No flag: the post-processor in tokenizer.json is what HF uses to add BOS (e.g. Llama 3).
            probe = backend.encode("", add_special_tokens=True).ids
            add_bos = bos_id is not None and probe[:1] == [bos_id]
        return cls._assemble(
            backend,
            bos_id=bos_id,
            eos_id=eos_id,
            extra_eos=extra_eos,
            add_bos=bool(add_bos),
            templates=_hf_templates(root, config),
        )

    @classmethod
    def _assemble(
        cls,
        backend: Backend,
        *,
        bos_id: int | None,
        eos_id: int | None,
        extra_eos: set[int],
        add_bos: bool,
        templates: Mapping[str, str | None],
    ) -> Tokenizer:
        special = frozenset(i for i, added in backend.get_added_tokens_decoder().items() if added.special)
        eos_ids = frozenset(extra_eos | set(_end_of_turn_ids(backend, special)))
        # markers of reasoning and tool calls stay in decoded text even where a vocabulary flags them special
        # (Mistral's [TOOL_CALLS], Llama's <|python_tag|>): the server's output parser reads them
        kept = KEPT_MARKERS | (set(HARMONY_MARKERS) if backend.token_to_id("<|channel|>") is not None else set())
        special = frozenset(i for i in special if backend.id_to_token(i) not in kept)
        bos = backend.id_to_token(bos_id) if bos_id is not None else None
        eos = backend.id_to_token(eos_id) if eos_id is not None else None
        compiled: dict[str, ChatTemplate] = {}
        error = None
        for name, source in templates.items():
            if not source:
                continue
            try:
                compiled[name] = ChatTemplate(source, bos_token=bos, eos_token=eos)
            except ChatTemplateError as exc:
                log.warning("the model's %r chat template is unusable: %s", name, exc)
                error = error or str(exc)
        return cls(
            backend=backend,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            eos_token_ids=eos_ids,
            add_bos_token=add_bos and bos_id is not None,
            special_ids=special,
            byte_fallback_ids=_byte_fallback_ids(backend),
            chat_template=compiled.get("default"),
            tool_use_template=compiled.get("tool_use"),
            chat_template_error=None if "default" in compiled else error,
        )

    # ---- text <-> ids ---------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in it are matched whole. With `add_special_tokens`,
        BOS is prepended if the model asks for it (leave it off for rendered chat templates that write it)."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """With `skip_special_tokens`, drops `special_ids` (so never the markers of KEPT_MARKERS)."""
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self.special_ids]
        return self.backend.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes `token_id` adds to an output it does not start: a sentencepiece token keeps its leading space,
        a byte token or a piece of a UTF-8 character gives its raw bytes (not the U+FFFD it decodes to alone)."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self)
        return self._token_bytes(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def block_end_ids(self) -> frozenset[int]:
        """Ids of the BLOCK_END_MARKERS this vocabulary holds as single tokens."""
        return frozenset(i for i in map(self.backend.token_to_id, BLOCK_END_MARKERS) if i is not None)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    # ---- chat -----------------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        reasoning_effort: str | None = None,
    ) -> str:
        """`reasoning_effort` ("low", "medium", "high") reaches templates that read it (gpt-oss's) only when set."""
        template = (self.tool_use_template if tools else None) or self.chat_template
        if template is None and self.chat_template_error:
            raise ChatTemplateError(f"{self.chat_template_error} (pass the prompt as plain text with --raw)")
        if template is None:
            raise ChatTemplateError(
                "this model has no chat template: pass the prompt as plain text with --raw, or give a template"
            )
        extra = {} if reasoning_effort is None else {"reasoning_effort": reasoning_effort}
        return template.render(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking,
            **extra,
        )


class IncrementalDecoder:
    """Turns generated ids into text as they arrive, one `push` per id.

    Text is emitted only once it is final:
    - while the decoded tail ends in U+FFFD (a UTF-8 sequence cut between byte tokens) it is held back;
    - with a byte-fallback vocabulary, a run of `<0xNN>` tokens is held until a non-byte token ends it,
      because the decoder judges a run as a whole: one bad byte later turns the entire run into U+FFFD.
    Each step decodes a short window that starts at the ids emitted last time and diffs it against that
    window's own decoding, so context-dependent decoding (sentencepiece drops the space of whichever token
    comes first) cancels out.
    """

    __slots__ = ("_tokenizer", "_skip", "_ids", "_prefix", "_read")

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: first id of the last emitted step
        self._read = 0  # everything before this has been emitted

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        self._ids.append(token_id)
        if self._in_byte_run(token_id):
            return ""
        seen = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(seen) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(seen) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete UTF-8 tail decodes to U+FFFD here, as in `decode`)."""
        seen = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return text[len(seen) :]

    def _in_byte_run(self, token_id: int) -> bool:
        # A skipped special token is invisible to the decoder, so it does not end a run either.
        if self._skip and token_id in self._tokenizer.special_ids:
            last = next((i for i in reversed(self._ids) if i not in self._tokenizer.special_ids), None)
            return last in self._tokenizer.byte_fallback_ids
        return token_id in self._tokenizer.byte_fallback_ids

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip) if ids else ""


def _optional(value: int | None) -> tuple[int, ...]:
    return () if value is None else (int(value),)


def _end_of_turn_ids(backend: Backend, special: frozenset[int]) -> list[int]:
    found = {name: backend.token_to_id(name) for name in END_OF_TURN_TOKENS}
    if found["<|return|>"] is not None and found["<|call|>"] is not None:
        found["<|end|>"] = None
    return [i for i in found.values() if i is not None and i in special]


def _byte_fallback_ids(backend: Backend) -> frozenset[int]:
    if not getattr(backend.model, "byte_fallback", False):
        return frozenset()
    vocab = backend.get_vocab(with_added_tokens=False)
    return frozenset(i for token, i in vocab.items() if _BYTE_TOKEN.fullmatch(token))


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path} is not valid JSON: {' '.join(str(exc).split())}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} should hold a JSON object")
    return data


def _token_id_of(backend: Backend, token: Any) -> int | None:
    # tokenizer_config.json spells a special token as a string or as a serialized AddedToken dict.
    content = token.get("content") if isinstance(token, dict) else token
    return backend.token_to_id(content) if isinstance(content, str) else None


def _hf_templates(root: Path, config: Mapping[str, Any]) -> dict[str, str | None]:
    """Named templates: chat_template.jinja (newest layout) overrides the config's default template."""
    raw = config.get("chat_template")
    if raw is None:
        raw = _read_json(root / "chat_template.json").get("chat_template")
    if isinstance(raw, list):
        templates = {
            t["name"]: t.get("template") for t in raw if isinstance(t, dict) and isinstance(t.get("name"), str)
        }
    else:
        templates = {"default": raw if isinstance(raw, str) else None}
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        try:
            templates["default"] = jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerError(f"{jinja} could not be read: {exc}") from None
    return templates
