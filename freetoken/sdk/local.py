"""The in-process SDK: `Engine.load(...)`, `engine.session(...)`, and sessions that send, fork, checkpoint,
roll back and edit their history while reusing every K/V they can.

A session keeps its conversation (template messages) and one KV sequence holding the tokens of the conversation
as last rendered. Each `send` renders the whole conversation with the new message, keeps the longest common
prefix of tokens already in the cache and computes only the rest: an edit in the middle recomputes from the
edit on, a rollback or a fork starts from pages it shares. `fork()` shares every page (nothing is copied until a
branch writes into a shared page); a checkpoint holds a fork of the sequence, so rolling back is as cheap.

A model with recurrent layers cannot drop tokens from its state, so its sessions snapshot the sequence (a fork:
shared pages, a copy of the small state) at semantic boundaries while prefilling: the end of each message in
the rendered prompt (tool results are messages), the end of each reasoning block and tool call inside one (where
the vocabulary has their closing markers as tokens), and every SNAPSHOT_EVERY tokens inside long stretches. A
send then restarts from the last snapshot at or before the first changed token: an agent that drops old
reasoning or rewrites a tool result recomputes from there, not from the message's start.

One worker thread runs every operation of an engine's sessions in order (generation, fork, rollback, ...), so
replies can be read from any thread or event loop and sessions never race; a reply is generated whether or not
it is read.
"""

from __future__ import annotations

import copy
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from freetoken.engine.generator import Generator, run_settings
from freetoken.engine.prefix_cache import PrefixCache
from freetoken.engine.sampling import SamplingParams
from freetoken.errors import FreeTokenError
from freetoken.sdk.conversation import Conversation, Sampling, assistant_message
from freetoken.sdk.reply import Reply, ReplyStats
from freetoken.server.engine import render_chat, template_messages


class Worker:
    """One thread running jobs in the order they were queued."""

    def __init__(self, name: str):
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def run(self, job: Callable[[], Any]) -> Any:
        """Runs `job` on the worker, after everything queued before it; returns its result (or raises)."""
        done: queue.Queue = queue.Queue(maxsize=1)
        self._jobs.put(lambda: done.put(_outcome(job)))
        ok, value = done.get()
        if not ok:
            raise value
        return value

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=60)


class Engine(Worker):
    """A loaded model and the worker that runs its sessions. Use `Engine.load(...)`, then `engine.session()`."""

    def __init__(self, lm, *, max_seq_len: int | None = None, kv_tokens: int | None = None,
                 speculative: bool = False):
        """`max_seq_len`: tokens one conversation may hold (default: the model's context); `kv_tokens`: tokens
        all sessions, forks and checkpoints hold together (default: unbounded on the CPU, where the pool grows;
        two contexts on CUDA, where CUDA graphs need it allocated up front). Shared pages count once.
        `speculative`: replies decode with the model's multi-token-prediction layer drafting (loaded with
        `mtp=True`; see engine/speculative.py)."""
        self.lm = lm
        graphs = lm.device.type == "cuda" and not speculative
        self.generator = Generator(lm, max_seq_len=max_seq_len, speculative=speculative, pool_tokens=kv_tokens or (
            2 * run_settings(lm, None, max_seq_len, None)[2] if graphs else None))
        self.cache = self.generator.cache()
        # whole pages of every session's history, so a new session (a subagent with the same system prompt and
        # tools) starts on them; not for recurrent models, whose state cannot start from shared pages
        self.prefix = None
        if not lm.has_recurrent_state:
            self.prefix = PrefixCache(self.cache.page_size, self.cache.allocator.retain, self.cache.allocator.free,
                                      max_pages=None if self.cache.max_pages else 4 * -(-self.generator.capacity
                                                                                       // self.cache.page_size))
            self.cache.reclaim = self.prefix.evict
            self.cache.remap_hooks.append(self.prefix.renumber)
        super().__init__("ft-sdk")

    @classmethod
    def load(cls, model: str | None = None, *, device: str = "auto", dtype: str | None = None,
             expert_cache: int | str | None = None, max_seq_len: int | None = None, kv_tokens: int | None = None,
             progress: bool = False, speculative: bool = False, **options: Any) -> Engine:
        """Loads `model` (an HF directory, a .gguf file, a cached HF repo id; default: the embedded SmolLM2).
        `expert_cache` keeps routed experts in host memory behind a device cache of that many bytes ("8GiB",
        "auto"); `speculative` loads the model's multi-token-prediction layer and decodes with its drafts
        (DeepSeek-V3/V4, GLM-4.5/5, Qwen3-Next, Qwen3.5 checkpoints that carry one); other options go to the loader
        (`expert_policy`, `block_share`)."""
        import torch

        from freetoken.engine.loader import load_model
        from freetoken.units import parse_bytes

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        cache = parse_bytes(expert_cache) if isinstance(expert_cache, str) and expert_cache != "auto" \
            else expert_cache
        lm = load_model(model, device=device, dtype=torch_dtype, expert_cache=cache, progress=progress,
                        mtp=speculative, **options)
        return cls(lm, max_seq_len=max_seq_len, kv_tokens=kv_tokens, speculative=speculative)

    def session(self, system: str | None = None, tools: Sequence[Mapping[str, Any]] | None = None,
                messages: Sequence[Mapping[str, Any]] = ()) -> Session:
        """A new conversation: an optional system prompt, tools (OpenAI function shape), earlier messages."""
        history = ([{"role": "system", "content": system}] if system else []) + [dict(m) for m in messages]
        return Session(self, history, list(tools) if tools else None)


def _outcome(job: Callable[[], Any]) -> tuple[bool, Any]:
    try:
        return True, job()
    except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
        return False, e


class Session(Conversation):
    """One conversation on an engine. `send` returns a `Reply` at once; the reply's text, reasoning, tool calls
    and stats are there once it completes (iterate it to stream). Messages are OpenAI-style dicts; a plain
    string is a user message."""

    def __init__(self, engine: Engine, messages: list[dict], tools: list[dict] | None):
        self.engine, self._messages, self.tools = engine, messages, tools
        self._seq = engine.cache.new_sequence()
        self._tokens: list[int] = []  # what `_seq` holds
        self._checkpoints: dict[str, tuple[list[dict], list[int], Any]] = {}
        self._snapshots: dict[int, Any] = {}  # recurrent models: token offset → a fork of `_seq` taken there

    def _produce(self, msg: dict, sampling: Sampling, reply: Reply) -> ReplyStats:
        lm, cache = self.engine.lm, self.engine.cache
        messages = self._messages + [msg]
        choice, tools = sampling.tool_choice, self.tools
        # rendered as the server renders it: tools a template ignores described in the system message, a forced
        # call's opening written after the generation prompt, calls constrained where the format allows
        chat = render_chat(lm.tokenizer, messages, tools, enable_thinking=False if sampling.json else None,
                           choice=choice)
        if sampling.json and chat.in_reasoning:
            raise FreeTokenError("this model's chat template opens a reasoning block the reply must close first, "
                                 "so it cannot be constrained to a JSON object; send without json=True")
        params = chat.constrain(SamplingParams(
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            max_tokens=sampling.max_tokens, stop=sampling.stop, seed=sampling.seed, json_object=sampling.json,
            json_schema=sampling.schema))
        prompt = chat.ids
        common = _common_prefix(self._tokens, prompt, limit=len(prompt) - 1)
        if lm.has_recurrent_state:
            common = self._restore_before(common)
            for end in self._boundaries(messages, tools, prompt, after=common):  # snapshots while prefilling
                self.engine.generator.prefill(self._seq, prompt[self._seq.length:end])
                self._snapshots[end] = cache.fork(self._seq)
            common_reused, common = common, self._seq.length
        else:
            common = self._adopt_longer_prefix(prompt, common)
            cache.truncate(self._seq, common)  # history past an edit, or the end of the last reply, recomputed
            common_reused = common
        self._tokens = prompt[:common]
        parser = chat.parser()
        generated, parts, last = [], [], None
        try:
            for ev in self.engine.generator.extend(self._seq, prompt[common:], params, cached_tokens=common_reused):
                generated += ev.token_ids
                for part in parser.push(ev.text) + (parser.finish() if ev.finish_reason else []):
                    parts.append(part)
                    reply.put(part)
                last = ev
        finally:
            self._tokens = (prompt + generated)[:self._seq.length]
            reply.generated_ids = generated
        self._messages = messages + [assistant_message(parts)]
        if self.engine.prefix is not None:
            self.engine.prefix.insert(self._tokens, self._seq.pages)
        calls = any(p.kind == "tool_call" for p in parts)
        t = last.timings
        decode = (last.completion_tokens - 1) / t.decode_s if t and t.decode_s > 0 and last.completion_tokens > 1 \
            else None
        return ReplyStats(last.prompt_tokens, common_reused, last.completion_tokens,
                          t.first_token_s if t else None, decode, "tool_calls" if calls else last.finish_reason)

    def _adopt_longer_prefix(self, prompt: list[int], common: int) -> int:
        """Another session's pages when they hold a longer start of `prompt` than this session's own history."""
        prefix = self.engine.prefix
        if prefix is None:
            return common
        shared = prefix.match(prompt)
        if len(shared) * self.engine.cache.page_size <= common:
            return common
        cache = self.engine.cache
        cache.release(self._seq)
        self._seq = cache.new_sequence()
        cache.adopt(self._seq, shared)
        return self._seq.length

    def _restore_before(self, common: int) -> int:
        """Recurrent models: where this send starts. The sequence as it is when the prompt continues it
        exactly; else the last snapshot at or before `common` (later ones belong to the old history), or an
        empty sequence. Returns the number of prompt tokens reused."""
        cache = self.engine.cache
        if common == self._seq.length:
            return common
        best = max((at for at in self._snapshots if at <= common), default=0)
        for at in [at for at in self._snapshots if at > best]:
            cache.release(self._snapshots.pop(at))
        cache.release(self._seq)
        self._seq = cache.fork(self._snapshots[best]) if best else cache.new_sequence()
        return best

    SNAPSHOT_EVERY = 4096  # tokens between snapshots inside one long message (a coarse fallback)

    def _boundaries(self, messages: list[dict], tools: list[dict] | None, prompt: list[int], after: int) -> list[int]:
        """Token offsets in `prompt` where a message ends (where its rendering alone is a prefix of the prompt),
        where a reasoning block or tool call ends (after its closing marker), plus every SNAPSHOT_EVERY tokens,
        past `after` and before the prompt's last token."""
        tok = self.engine.lm.tokenizer
        every = self.SNAPSHOT_EVERY
        ends = [at for at in range(every, len(prompt), every) if at > after]
        closing = tok.block_end_ids()
        ends += [i + 1 for i in range(after, len(prompt) - 1) if prompt[i] in closing]
        rendered = template_messages(tok, messages, tools)[0]  # (tools described in the system message too)
        for i in range(1, len(rendered) + 1):
            try:
                ids = tok.encode(tok.apply_chat_template(rendered[:i], tools=tools, add_generation_prompt=False))
            except Exception:  # noqa: BLE001 - a template that cannot render a partial conversation: no boundary
                continue
            if after < len(ids) < len(prompt) and prompt[:len(ids)] == ids:
                ends.append(len(ids))
        return sorted(set(ends))

    def fork(self) -> Session:
        """A second session with this one's history, sharing its K/V (nothing is copied until one writes)."""
        def make() -> Session:
            child = Session.__new__(Session)
            child.engine, child._messages, child.tools = self.engine, copy.deepcopy(self._messages), self.tools
            cache = self.engine.cache
            child._seq, child._tokens = cache.fork(self._seq), list(self._tokens)
            # the snapshots too (a recurrent model's state is copied, its K/V shared): an edit in the child then
            # restarts from the last one before it, not from the first token
            child._checkpoints, child._snapshots = {}, {at: cache.fork(seq) for at, seq in self._snapshots.items()}
            return child

        return self.engine.run(make)

    def checkpoint(self, name: str) -> None:
        """Remembers the conversation and its K/V as they are (after every queued reply) under `name`."""
        def take() -> None:
            old = self._checkpoints.pop(name, None)
            if old is not None:
                self.engine.cache.release(old[2])
            self._checkpoints[name] = (copy.deepcopy(self._messages), list(self._tokens),
                                       self.engine.cache.fork(self._seq))

        self.engine.run(take)

    def rollback(self, name: str) -> None:
        """Back to checkpoint `name`: its conversation, and its K/V (shared, not recomputed)."""
        def restore() -> None:
            if name not in self._checkpoints:
                raise FreeTokenError(f"no checkpoint {name!r}; this session has {sorted(self._checkpoints)}")
            messages, tokens, seq = self._checkpoints[name]
            cache = self.engine.cache
            cache.release(self._seq)
            # snapshots within the history the checkpoint shares with the present one still hold
            shared = next((i for i, (a, b) in enumerate(zip(tokens, self._tokens, strict=False)) if a != b),
                          min(len(tokens), len(self._tokens)))
            for at in [at for at in self._snapshots if at > shared]:
                cache.release(self._snapshots.pop(at))
            self._messages, self._tokens, self._seq = copy.deepcopy(messages), list(tokens), cache.fork(seq)

        self.engine.run(restore)

    def _drop_snapshots(self) -> None:
        for seq in self._snapshots.values():
            self.engine.cache.release(seq)
        self._snapshots = {}

    def close(self) -> None:
        """Frees the session's K/V and its checkpoints'."""
        def free() -> None:
            cache = self.engine.cache
            cache.release(self._seq)
            for _, _, seq in self._checkpoints.values():
                cache.release(seq)
            self._drop_snapshots()
            self._checkpoints, self._tokens = {}, []

        self.engine.run(free)


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y or n >= limit:
            break
        n += 1
    return n
