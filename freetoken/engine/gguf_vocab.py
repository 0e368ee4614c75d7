"""Rebuilding a model's tokenizer from a GGUF file's vocabulary metadata, as an in-memory `tokenizers` object.

A GGUF carries no `tokenizer.json`, only llama.cpp's description of the vocabulary: token strings, scores,
token types, BPE merges and a pre-tokenizer name. This module turns that into the `tokenizers.Tokenizer` that
tokenizes the way llama.cpp does for the same file:

- `tokenizer.ggml.model == "gpt2"`: byte-level BPE. The file's merges are used as is, and the text is split
  first by the regexes llama.cpp associates with `tokenizer.ggml.pre` (one `Split` per regex, applied in
  order, as llama.cpp's `unicode_regex_split` does), then mapped to the GPT-2 byte alphabet.
- `tokenizer.ggml.model == "llama"`: a sentencepiece BPE vocabulary. Merges are recovered from the scores
  (a pair merges when the joined piece is in the vocabulary; higher score merges first, which is what
  sentencepiece's BPE encoder does), bytes missing from the vocabulary fall back to `<0xNN>` tokens, and
  spaces become "▁" with one prepended to every run of text when `add_space_prefix` says so (llama.cpp
  prepends after every special token too, which a normalizer reproduces: it runs once per text segment).

Invariants: token ids are the file's indices, unchanged; control, unknown and user-defined tokens are added
as atomic tokens (control and unknown as special) so text like `<|im_start|>` is never split; any malformed
metadata raises `TokenizerError` naming the key at fault.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from freetoken.errors import TokenizerError

log = logging.getLogger(__name__)

# llama.cpp's token types (tokenizer.ggml.token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SUPPORTED_MODELS = ("gpt2", "llama")

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    rf"{_CONTRACTIONS}?|\p{{N}}{{1,3}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek's first tokenizers split cased letters, ASCII-like punctuation and CJK runs apart before anything
# else; these are the code point ranges of the classes in their tokenizer.json. Written as numbers because
# several of them (U+1FBE, U+2126, U+212A, ...) are Unicode singletons that an editor's NFC would silently
# replace, emptying the ranges.
_DEEPSEEK_CASED = (
    (0x41, 0x5A), (0x61, 0x7A), (0xB5, 0xB5), (0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0x1BA), (0x1BC, 0x1BF),
    (0x1C4, 0x293), (0x295, 0x2AF), (0x370, 0x373), (0x376, 0x377), (0x37B, 0x37D), (0x37F, 0x37F),
    (0x386, 0x386), (0x388, 0x38A), (0x38C, 0x38C), (0x38E, 0x3A1), (0x3A3, 0x3F5), (0x3F7, 0x481),
    (0x48A, 0x52F), (0x531, 0x556), (0x10A0, 0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD), (0x1C90, 0x1CBA),
    (0x1CBD, 0x1CBF), (0x1D00, 0x1D2B), (0x1D6B, 0x1D77), (0x1D79, 0x1D9A), (0x1E00, 0x1F15), (0x1F18, 0x1F1D),
    (0x1F20, 0x1F45), (0x1F48, 0x1F4D), (0x1F50, 0x1F57), (0x1F59, 0x1F59), (0x1F5B, 0x1F5B), (0x1F5D, 0x1F5D),
    (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4), (0x1FB6, 0x1FBC), (0x1FBE, 0x1FBE), (0x1FC2, 0x1FC4), (0x1FC6, 0x1FCC),
    (0x1FD0, 0x1FD3), (0x1FD6, 0x1FDB), (0x1FE0, 0x1FEC), (0x1FF2, 0x1FF4), (0x1FF6, 0x1FFC), (0x2102, 0x2102),
    (0x2107, 0x2107), (0x210A, 0x2113), (0x2115, 0x2115), (0x2119, 0x211D), (0x2124, 0x2124), (0x2126, 0x2126),
    (0x2128, 0x2128), (0x212A, 0x212D), (0x212F, 0x2134), (0x2139, 0x2139), (0x213C, 0x213F), (0x2145, 0x2149),
    (0x214E, 0x214E), (0x2183, 0x2184), (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4), (0x2CEB, 0x2CEE), (0x2CF2, 0x2CF3),
    (0xA640, 0xA66D), (0xA680, 0xA69B), (0xA722, 0xA76F), (0xA771, 0xA787), (0xA78B, 0xA78E), (0xAB70, 0xABBF),
    (0xFB00, 0xFB06), (0xFB13, 0xFB17), (0xFF21, 0xFF3A), (0xFF41, 0xFF5A), (0x10400, 0x1044F),
    (0x104B0, 0x104D3), (0x104D8, 0x104FB), (0x10C80, 0x10CB2), (0x10CC0, 0x10CF2), (0x118A0, 0x118DF),
    (0x1E900, 0x1E943),
)  # fmt: skip
_DEEPSEEK_PUNCT = ((0x21, 0x2F), (0x3A, 0x7E), (0xFF01, 0xFF0F), (0xFF1A, 0xFF5E), (0x2018, 0x201F), (0x3000, 0x3002))
_DEEPSEEK_CJK = ((0x4E00, 0x9FA5), (0x800, 0x4E00), (0xAC00, 0xD7FF))
_CJK_KANA = ((0x4E00, 0x9FA5), (0x3040, 0x309F), (0x30A0, 0x30FF))


def _char_class(ranges: tuple[tuple[int, int], ...]) -> str:
    return "[" + "".join(f"\\x{{{lo:X}}}-\\x{{{hi:X}}}" for lo, hi in ranges) + "]"


_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"


@dataclass(frozen=True, slots=True)
class PreTokenizer:
    """How llama.cpp pre-splits text for one `tokenizer.ggml.pre` value."""

    patterns: tuple[str, ...]
    ignore_merges: bool = False  # a word that is itself a token is emitted whole (llama3, tekken)
    add_bos: bool = False  # llama.cpp's default when the file has no `add_bos_token`


_GPT2_PRE = PreTokenizer((_GPT2,))
_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_DIGITS_THEN_GPT2 = PreTokenizer((r"\p{N}", _GPT2))
_QWEN2_PRE = PreTokenizer((_QWEN2,))


def _names(names: str, pre: PreTokenizer) -> dict[str, PreTokenizer]:
    return dict.fromkeys(names.split(), pre)


# `tokenizer.ggml.pre` -> splitting rules, after llama.cpp's `llama_vocab::impl::load`. "default" (and a
# missing key) is the plain GPT-2 regex, which is also what transformers uses for such files.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **_names("default gpt2 gpt-2 phi-2 mpt olmo jais jina-es jina-de gigachat roberta-bpe exaone4", _GPT2_PRE),
    **_names("mellum trillion granite-docling a.x-4.0 jina-v2-es jina-v2-de jina-v1-en jina-v2-code", _GPT2_PRE),
    **_names("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2", _LLAMA3_PRE),
    **_names("dbrx smaug-bpe", PreTokenizer((_LLAMA3,))),
    **_names("chatglm-bpe glm4", PreTokenizer((_LLAMA3,))),
    **_names("qwen2 deepseek-r1-qwen kormo megrez stablelm2 hunyuan grok-2", _QWEN2_PRE),
    "qwen35": PreTokenizer((_QWEN35,)),
    **_names("smollm starcoder refact command-r codeshell exaone minerva-7b", _DIGITS_THEN_GPT2),
    **_names("gpt-4o llama4 minimax-m2", PreTokenizer((_GPT4O,))),
    "tekken": PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
    "deepseek-llm": PreTokenizer(
        (
            r"[\r\n]",
            r"\s?" + _char_class(_DEEPSEEK_CASED) + "+",
            r"\s?" + _char_class(_DEEPSEEK_PUNCT) + "+",
            r"\s+$",
            _char_class(_DEEPSEEK_CJK) + "+",
            r"\p{N}+",
        )
    ),
    "deepseek-coder": PreTokenizer((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _char_class(_DEEPSEEK_CJK) + "+", r"\p{N}")),
    "deepseek-v3": PreTokenizer(
        (
            r"\p{N}{1,3}",
            _char_class(_CJK_KANA) + "+",
            r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
            r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        )
    ),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    **_names("bloom poro-chat gpt3-finnish", PreTokenizer((_BLOOM,))),
    "viking": PreTokenizer((_BLOOM, r"\p{N}")),
}


def pre_tokenizer_for(name: str | None) -> PreTokenizer:
    """The splitting rules for `tokenizer.ggml.pre`; unknown names fall back to GPT-2's, as llama.cpp does."""
    if name is None:
        return _GPT2_PRE
    pre = PRE_TOKENIZERS.get(name)
    if pre is None:
        log.warning("unknown tokenizer.ggml.pre %r: splitting text with the GPT-2 regex instead", name)
        return _GPT2_PRE
    return pre


@dataclass(slots=True)
class GGUFVocab:
    """The backend built from a GGUF, plus the vocabulary facts `Tokenizer` needs from the metadata."""

    backend: Backend
    add_bos: bool
    bos_token_id: int | None
    eos_token_id: int | None
    end_of_turn_ids: tuple[int, ...]  # tokenizer.ggml.eot_token_id / eom_token_id, when the file states them


def build_gguf_vocab(metadata: Mapping[str, Any]) -> GGUFVocab:
    """Build the tokenizer described by GGUF `metadata` (a dict of key -> parsed value)."""
    model = metadata.get("tokenizer.ggml.model")
    if model not in SUPPORTED_MODELS:
        raise TokenizerError(
            f"unsupported GGUF tokenizer.ggml.model {model!r}: supported are {', '.join(SUPPORTED_MODELS)}"
        )
    tokens = _tokens(metadata)
    types = _int_list(metadata, "tokenizer.ggml.token_type", len(tokens)) or [NORMAL] * len(tokens)
    if model == "gpt2":
        pre = pre_tokenizer_for(metadata.get("tokenizer.ggml.pre"))
        backend = _byte_level(tokens, _merges(metadata), pre)
        default_add_bos = pre.add_bos
    else:
        scores = metadata.get("tokenizer.ggml.scores")
        if scores is None:
            raise TokenizerError("GGUF sentencepiece vocabulary has no tokenizer.ggml.scores: the file is damaged")
        scores = [float(s) for s in scores]
        if len(scores) != len(tokens):
            raise TokenizerError("GGUF tokenizer.ggml.scores and tokenizer.ggml.tokens differ in length")
        unk_id = _token_id(metadata, "unknown", len(tokens))
        add_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
        backend = _sentencepiece(tokens, types, scores, unk_id, add_prefix)
        default_add_bos = True  # llama.cpp adds BOS for sentencepiece vocabularies unless told otherwise
    _add_atomic_tokens(backend, tokens, types)
    eot = [_token_id(metadata, kind, len(tokens)) for kind in ("eot", "eom")]
    return GGUFVocab(
        backend=backend,
        add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", default_add_bos)),
        bos_token_id=_token_id(metadata, "bos", len(tokens)),
        eos_token_id=_token_id(metadata, "eos", len(tokens)),
        end_of_turn_ids=tuple(i for i in eot if i is not None),
    )


def _tokens(metadata: Mapping[str, Any]) -> list[str]:
    raw = metadata.get("tokenizer.ggml.tokens")
    if raw is None or len(raw) == 0:
        raise TokenizerError("GGUF file has no tokenizer.ggml.tokens: it carries no vocabulary to tokenize with")
    tokens: list[str] = []
    seen: set[str] = set()
    for i, token in enumerate(raw):
        if isinstance(token, bytes):
            token = token.decode("utf-8", errors="replace")
        if not isinstance(token, str):
            raise TokenizerError(f"GGUF tokenizer.ggml.tokens[{i}] is not a string")
        token = token or f"[EMPTY_{i}]"  # llama.cpp's name for an empty entry, so ids stay dense
        if token in seen:
            raise TokenizerError(f"GGUF tokenizer.ggml.tokens lists {token!r} twice: the file is damaged")
        seen.add(token)
        tokens.append(token)
    return tokens


def _int_list(metadata: Mapping[str, Any], key: str, length: int) -> list[int] | None:
    values = metadata.get(key)
    if values is None:
        return None
    out = [int(v) for v in values]  # numpy arrays and lists alike
    if len(out) != length:
        raise TokenizerError(f"GGUF {key} has {len(out)} entries for {length} tokens: the file is damaged")
    return out


def _token_id(metadata: Mapping[str, Any], kind: str, n_tokens: int) -> int | None:
    value = metadata.get(f"tokenizer.ggml.{kind}_token_id")
    if value is None:
        return None
    value = int(value)
    if not 0 <= value < n_tokens:
        log.warning("GGUF tokenizer.ggml.%s_token_id %d is outside the vocabulary; ignoring it", kind, value)
        return None
    return value


def _merges(metadata: Mapping[str, Any]) -> list[tuple[str, str]]:
    raw = metadata.get("tokenizer.ggml.merges")
    if raw is None:
        raise TokenizerError("GGUF byte-level BPE vocabulary has no tokenizer.ggml.merges: the file is damaged")
    merges = []
    for merge in raw:
        # Search from index 1: a piece may itself start with a space in some vocabularies (llama.cpp does too).
        cut = merge.find(" ", 1)
        if cut < 0:
            raise TokenizerError(f"GGUF tokenizer.ggml.merges entry {merge!r} is not two tokens")
        merges.append((merge[:cut], merge[cut + 1 :]))
    return merges


def _byte_level(tokens: Sequence[str], merges: list[tuple[str, str]], pre: PreTokenizer) -> Backend:
    vocab = {token: i for i, token in enumerate(tokens)}
    try:
        model = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges)
    except Exception as exc:  # tokenizers rejects merges whose pieces or result are missing from the vocab
        raise TokenizerError(f"GGUF BPE merges do not fit the vocabulary: {exc}") from None
    backend = Backend(model)
    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in pre.patterns]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(
    tokens: Sequence[str], types: Sequence[int], scores: Sequence[float], unk_id: int | None, add_prefix: bool
) -> Backend:
    vocab = {token: i for i, token in enumerate(tokens)}
    unk = tokens[unk_id] if unk_id is not None else ("<unk>" if "<unk>" in vocab else None)
    model = models.BPE(
        vocab=vocab,
        merges=_merges_from_scores(tokens, types, scores),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = Backend(model)
    steps = [normalizers.Replace(" ", "▁")]
    if add_prefix:
        steps.insert(0, normalizers.Prepend("▁"))
    backend.normalizer = normalizers.Sequence(steps)
    backend.pre_tokenizer = None
    undo = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        undo.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(undo)
    return backend


def _merges_from_scores(tokens: Sequence[str], types: Sequence[int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two normal pieces, best (highest-scoring) result first.

    Sentencepiece's BPE encoder repeatedly joins the adjacent pair whose join has the highest score; a BPE
    model that applies merges in this order makes the same choices.
    """
    normal = {token: i for i, token in enumerate(tokens) if types[i] == NORMAL}
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, index in normal.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[index], normal[left], normal[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_atomic_tokens(backend: Backend, tokens: Sequence[str], types: Sequence[int]) -> None:
    special = [
        AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t in (CONTROL, UNKNOWN)
    ]
    plain = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == USER_DEFINED]
    before = backend.get_vocab_size(with_added_tokens=True)
    backend.add_special_tokens(special)
    backend.add_tokens(plain)
    # Each is already in the model's vocabulary, so adding it must reuse its id, never append a new one.
    if backend.get_vocab_size(with_added_tokens=True) != before:
        raise TokenizerError("GGUF special tokens do not match the vocabulary: the file is damaged")
