"""Tokenizer: GGUF byte-level (SmolLM2) and sentencepiece vocabularies and HF directories, each checked
against its reference implementation (transformers, sentencepiece), plus the streaming decoder."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from freetoken.engine.formats.gguf_file import GGUFFile
from freetoken.engine.gguf_vocab import PRE_TOKENIZERS, build_gguf_vocab
from freetoken.engine.tokenizer import IncrementalDecoder, Tokenizer
from freetoken.errors import ChatTemplateError, TokenizerError
from support.tiny_vocabs import byte_level_metadata

BYTE_LEVEL_TEXTS = [
    "",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    "Ünïcödé façade — naïve café, 日本語のテキスト, 한국어, Ελληνικά, русский, العربية",
    "🤗🚀 emoji 👩‍👩‍👧 flags 🇫🇷 and a lone \u200b zero-width",
    "3.14159 and 1234567890, on 2024-01-31 at 12:00:00",
    "  leading\t\ttabs\n\n\nnewlines   trailing   ",
    "\r\n\r\n     ",
    "I'm sure you're right; they'll've done it, DON'T",
    "<|im_start|>system\nYou are SmolLM.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
    "x<|endoftext|>y<repo_name>z<file_sep> <|im_end|>",
    "a" * 300,
]
CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is 2+2? Answer in 日本語 🤗"},
    {"role": "assistant", "content": "四 (4)."},
]


def short(text: str) -> str:
    return repr(text)[:32]


def stream(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
    decoder = IncrementalDecoder(tokenizer, skip_special_tokens=skip_special_tokens)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


def assert_streams_like_decode(tokenizer: Tokenizer, n_vocab: int, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(150):
        ids = [rng.randrange(n_vocab) for _ in range(rng.randint(1, 24))]
        for skip in (False, True):
            assert "".join(stream(tokenizer, ids, skip)) == tokenizer.decode(ids, skip_special_tokens=skip), ids


def assert_token_bytes_spell(tokenizer: Tokenizer, text: str, spelled: str) -> None:
    """Each token's bytes, as it reads inside an output, joined: `spelled` (`text` as the tokens write it), with
    some token holding only part of a character (its raw bytes, not the U+FFFD it decodes to alone)."""
    pieces = [tokenizer.token_bytes(i) for i in tokenizer.encode(text)]
    assert b"".join(pieces) == spelled.encode()
    assert any(_broken(piece) for piece in pieces)


def _broken(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return True
    return False


# ---- SmolLM2 GGUF (byte-level BPE, pre "smollm") against transformers --------------------------------------


@pytest.fixture(scope="module")
def smol_metadata(smollm2_gguf: Path) -> dict:
    with GGUFFile.open(smollm2_gguf) as gguf:
        return dict(gguf.metadata)


@pytest.fixture(scope="module")
def smol(smol_metadata: dict) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(smol_metadata)


@pytest.fixture(scope="module")
def smol_reference(smollm2_gguf: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


@pytest.mark.parametrize("text", BYTE_LEVEL_TEXTS, ids=short)
def test_smollm2_encodes_like_transformers(smol: Tokenizer, smol_reference, text: str) -> None:
    ids = smol.encode(text)
    assert ids == smol_reference.encode(text, add_special_tokens=False)
    assert smol.encode(text, add_special_tokens=True) == smol_reference.encode(text)  # the file says: no BOS
    assert smol.decode(ids) == text
    assert smol.decode(ids) == smol_reference.decode(ids, clean_up_tokenization_spaces=False)
    assert smol.decode(ids, skip_special_tokens=True) == smol_reference.decode(
        ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )


def test_smollm2_chat_template_matches_transformers(smol: Tokenizer, smol_reference) -> None:
    expected = smol_reference.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert smol.apply_chat_template(CONVERSATION) == expected
    assert smol.apply_chat_template(CONVERSATION[1:]).startswith("<|im_start|>system\nYou are a helpful")


def test_smollm2_special_ids(smol: Tokenizer) -> None:
    assert smol.vocab_size == 49152
    assert (smol.bos_token_id, smol.eos_token_id) == (1, 2)
    assert smol.id_to_token(2) == "<|im_end|>" and smol.token_to_id("<|im_start|>") == 1
    assert smol.eos_token_ids == frozenset({2, smol.token_to_id("<|endoftext|>")})
    assert smol.encode("<|im_start|>user") == [1, smol.encode("user")[0]]  # matched whole, never split


def test_smollm2_streaming(smol: Tokenizer) -> None:
    text = "Emoji 🤗🇫🇷 and CJK 日本語 and Ελληνικά"
    ids = smol.encode(text)
    pieces = stream(smol, ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)  # split UTF-8 sequences are held back, never emitted broken
    assert len([p for p in pieces if p]) > 5  # and text does flow before the end
    assert_streams_like_decode(smol, smol.vocab_size, seed=0)


def test_smollm2_token_bytes(smol: Tokenizer) -> None:
    text = "Emoji 🤗🇫🇷 and CJK 日本語, café → x<|im_end|>"
    assert_token_bytes_spell(smol, text, text)
    assert smol.token_bytes(smol.token_to_id("<|im_end|>")) == b"<|im_end|>"


# ---- sentencepiece vocabulary (GGUF "llama") against sentencepiece itself --------------------------------------

SPM_WORDS = "the quick brown fox jumps over lazy dogs hello world tokens models sentence piece".split()
SPM_WORDS += "café naïve über straße résumé déjà vu".split()
SPM_TEXTS = [
    "",
    " ",
    "  ",
    "hello world",
    " leading space",
    "double  space and trailing ",
    "the quick brown fox jumps over the lazy dog",
    "über café naïve straße résumé",
    "emoji 🤗 and 日本語 are not in the vocabulary",
    "new\nline\ttab\r\nreturn",
    "ZZZ QQQ xyzzy ŉǅﬁ",
    "quickly jumped foxes",
]


@pytest.fixture(scope="module", params=[True, False], ids=["space-prefix", "no-space-prefix"])
def spm(request) -> tuple:
    """A tiny sentencepiece BPE model and the GGUF metadata llama.cpp's converter would write for it."""
    sentencepiece = pytest.importorskip("sentencepiece")
    model_pb2 = pytest.importorskip("sentencepiece.sentencepiece_model_pb2")
    rng = random.Random(1)
    lines = [" ".join(rng.choice(SPM_WORDS) for _ in range(rng.randint(3, 12))) for _ in range(400)]
    proto = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=proto,
        model_type="bpe",
        vocab_size=400,  # 256 byte pieces + specials + ~140 learned merges
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",  # GGUF carries no normalizer, so the reference must have none
        remove_extra_whitespaces=False,
        add_dummy_prefix=request.param,
        user_defined_symbols=["<tool>"],
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
        num_threads=1,
    )
    model = model_pb2.ModelProto()
    model.ParseFromString(proto.getvalue())
    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [p.piece for p in model.pieces],
        "tokenizer.ggml.scores": np.array([p.score for p in model.pieces], dtype=np.float32),
        "tokenizer.ggml.token_type": np.array([int(p.type) for p in model.pieces], dtype=np.int32),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_space_prefix": request.param,
    }
    assert {6, 4, 3, 2, 1} <= set(metadata["tokenizer.ggml.token_type"].tolist())  # byte, user, control, unk
    return sentencepiece.SentencePieceProcessor(model_proto=proto.getvalue()), metadata


@pytest.mark.parametrize("text", SPM_TEXTS, ids=short)
def test_sentencepiece_vocab_encodes_like_sentencepiece(spm: tuple, text: str) -> None:
    processor, metadata = spm
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    ids = tokenizer.encode(text)
    assert ids == processor.encode(text)
    assert tokenizer.decode(ids) == processor.decode(ids) == text
    assert tokenizer.encode(text, add_special_tokens=True) == [1, *ids]  # llama.cpp's default for SPM


def test_sentencepiece_vocab_details(spm: tuple) -> None:
    processor, metadata = spm
    tokenizer = Tokenizer.from_gguf_metadata({**metadata, "tokenizer.ggml.add_bos_token": False})
    assert tokenizer.encode("hi", add_special_tokens=True) == tokenizer.encode("hi")
    assert tokenizer.eos_token_ids == frozenset({2})
    emoji = tokenizer.encode("🤗")
    assert [tokenizer.id_to_token(i) for i in emoji][-4:] == ["<0xF0>", "<0x9F>", "<0xA4>", "<0x97>"]
    tool = tokenizer.token_to_id("<tool>")
    assert tool in tokenizer.encode("call<tool>now")  # user-defined: matched whole, not special
    assert "<tool>" in tokenizer.decode(tokenizer.encode("call<tool>now"), skip_special_tokens=True)
    assert tokenizer.decode([1, *tokenizer.encode("hi"), 2], skip_special_tokens=True) == "hi"


def test_sentencepiece_streaming(spm: tuple) -> None:
    processor, metadata = spm
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    text = " hello wörld 🤗 日本 naïve  end"
    ids = tokenizer.encode(text)
    pieces = stream(tokenizer, ids)
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert_streams_like_decode(tokenizer, tokenizer.vocab_size, seed=1)


def test_sentencepiece_token_bytes(spm: tuple) -> None:
    """A byte token is its byte; "▁" reads as the space it is inside an output, the first token's too (decoding
    drops it there when the vocabulary prepends one)."""
    _, metadata = spm
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    text = " hello wörld 🤗 日本 naïve → end"
    assert_token_bytes_spell(tokenizer, text, " " + text if metadata["tokenizer.ggml.add_space_prefix"] else text)
    assert tokenizer.token_bytes(tokenizer.token_to_id("<0xF0>")) == b"\xf0"


# ---- HF directory against transformers ---------------------------------------------------------------------

HF_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HF_SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|stop|>"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=HF_SPECIALS, initial_alphabet=alphabet, show_progress=False
    )
    backend.train_from_iterator([*BYTE_LEVEL_TEXTS, *SPM_TEXTS] * 20, trainer)
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.save(str(root / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "unk_token": "<unk>"}
    config |= {"eos_token": {"__type": "AddedToken", "content": "</s>"}, "chat_template": HF_TEMPLATE}
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    return root


@pytest.fixture(scope="module")
def hf_reference(hf_dir: Path):
    return pytest.importorskip("transformers").AutoTokenizer.from_pretrained(str(hf_dir))


@pytest.mark.parametrize("text", BYTE_LEVEL_TEXTS + SPM_TEXTS, ids=short)
def test_hf_dir_encodes_like_transformers(hf_dir: Path, hf_reference, text: str) -> None:
    reference = hf_reference
    tokenizer = Tokenizer.from_hf_dir(hf_dir)
    assert tokenizer.encode(text) == reference.encode(text, add_special_tokens=False)
    assert tokenizer.encode(text, add_special_tokens=True) == reference.encode(text)  # BOS via post-processor
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_hf_dir_chat_template_and_special_ids(hf_dir: Path, hf_reference) -> None:
    reference = hf_reference
    tokenizer = Tokenizer.from_hf_dir(hf_dir)
    expected = reference.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(CONVERSATION) == expected
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    # </s> (config) + <|stop|> (generation_config) + <|im_end|> (a special end-of-turn token)
    assert tokenizer.eos_token_ids == frozenset({2, 5, 4})
    assert_streams_like_decode(tokenizer, tokenizer.vocab_size, seed=2)


def test_hf_dir_template_sources(hf_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "generation_config.json"):
        (tmp_path / name).write_bytes((hf_dir / name).read_bytes())
    named = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "{{ tools | length }}"}]
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "chat_template": named}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_hf_dir(tmp_path)
    assert tokenizer.apply_chat_template(CONVERSATION) == "plain"
    assert tokenizer.apply_chat_template(CONVERSATION, tools=[{"name": "f"}]) == "1"
    assert tokenizer.encode("hi", add_special_tokens=True) == tokenizer.encode("hi")  # the config's flag wins
    (tmp_path / "chat_template.jinja").write_text("from jinja file")
    assert Tokenizer.from_hf_dir(tmp_path).apply_chat_template(CONVERSATION) == "from jinja file"


def test_hf_dir_errors(hf_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    tokenizer = Tokenizer.from_hf_dir(tmp_path)
    assert tokenizer.chat_template is None and tokenizer.eos_token_ids == frozenset({4})
    with pytest.raises(ChatTemplateError, match="--raw"):
        tokenizer.apply_chat_template(CONVERSATION)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_hf_dir_token_bytes(hf_dir: Path) -> None:
    text = "Ünïcödé façade — 日本語のテキスト 🤗"
    assert_token_bytes_spell(Tokenizer.from_hf_dir(hf_dir), text, text)


# ---- GGUF metadata: pre-tokenizer table and malformed input ----------------------------------------------------


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_every_known_pre_tokenizer_builds(pre: str) -> None:
    tokenizer = Tokenizer.from_gguf_metadata(byte_level_metadata(pre))
    text = "Hello, wörld! It's 12345 日本語 🤗\n\n  x"
    assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.parametrize(
    ("pre", "pieces"),
    [("gpt2", ["12345"]), ("llama-bpe", ["123", "45"]), ("qwen2", list("12345")), ("smollm", list("12345"))],
)
def test_pre_tokenizers_split_digits_like_llama_cpp(pre: str, pieces: list[str]) -> None:
    backend = build_gguf_vocab(byte_level_metadata(pre)).backend
    assert [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str("12345")] == pieces


def test_unknown_pre_tokenizer_falls_back_to_gpt2(caplog) -> None:
    tokenizer = Tokenizer.from_gguf_metadata(byte_level_metadata("no-such-pre"))
    assert "no-such-pre" in caplog.text
    assert tokenizer.encode("12345") == Tokenizer.from_gguf_metadata(byte_level_metadata("gpt2")).encode("12345")


def test_byte_level_control_and_user_defined_tokens() -> None:
    metadata = byte_level_metadata("qwen2", [("<|im_end|>", 3), ("<think>", 4), ("<|endoftext|>", 3)])
    metadata["tokenizer.ggml.eos_token_id"] = len(metadata["tokenizer.ggml.tokens"]) - 1
    tokenizer = Tokenizer.from_gguf_metadata(metadata)
    end, think, eot = (tokenizer.token_to_id(t) for t in ("<|im_end|>", "<think>", "<|endoftext|>"))
    ids = tokenizer.encode("a<think>b<|im_end|>")
    assert ids[1] == think and ids[-1] == end
    assert tokenizer.decode(ids, skip_special_tokens=True) == "a<think>b"
    assert tokenizer.eos_token_ids == frozenset({end, eot})
    assert tokenizer.chat_template is None


def test_gguf_templates_and_end_of_turn_id() -> None:
    metadata = byte_level_metadata("gpt2")
    metadata |= {"tokenizer.chat_template": "{% for %}", "tokenizer.chat_template.tool_use": "tools!"}
    metadata |= {"tokenizer.ggml.eot_token_id": 7, "tokenizer.ggml.eos_token_id": 8}
    tokenizer = Tokenizer.from_gguf_metadata(metadata)  # a broken template does not stop --raw use
    assert tokenizer.eos_token_ids == frozenset({7, 8})
    with pytest.raises(ChatTemplateError, match="line 1.*--raw"):
        tokenizer.apply_chat_template(CONVERSATION)
    assert tokenizer.apply_chat_template(CONVERSATION, tools=[{"name": "f"}]) == "tools!"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokenizer.ggml.model": "t5"}, "gpt2, llama"),
        ({"tokenizer.ggml.model": None}, "supported"),
        ({"tokenizer.ggml.tokens": []}, "tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.merges": None}, "merges"),
        ({"tokenizer.ggml.merges": ["12"]}, "merges"),
        ({"tokenizer.ggml.token_type": [1, 1]}, "token_type"),
        ({"tokenizer.ggml.model": "llama"}, "scores"),
    ],
)
def test_malformed_gguf_metadata(change: dict, message: str) -> None:
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_gguf_metadata({**byte_level_metadata("gpt2"), **change})


def test_deepseek_call_markers_stay_in_decoded_text_though_flagged_special(tmp_path: Path) -> None:
    """DeepSeek's tool-call markers (V3's `<｜tool▁calls▁begin｜>` …, V4's `｜DSML｜`) are special tokens of its
    vocabulary: decoding a reply for the user keeps them, or the server's parser never sees the calls."""
    from support.checkpoints import add_special_tokens, write_tokenizer

    write_tokenizer(tmp_path)
    add_special_tokens(tmp_path, ["｜DSML｜", "<｜tool▁calls▁begin｜>"])
    tokenizer = Tokenizer.from_hf_dir(tmp_path)
    reply = '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="now">\n</｜DSML｜invoke><｜tool▁calls▁begin｜><|im_start|>'
    ids = tokenizer.encode(reply)
    assert {tokenizer.token_to_id("｜DSML｜"), tokenizer.token_to_id("<｜tool▁calls▁begin｜>")} <= set(ids)
    assert tokenizer.decode(ids, skip_special_tokens=True) == reply.removesuffix("<|im_start|>")
