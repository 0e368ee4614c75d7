"""`ft serve --speculative` behind the official clients: a tiny DeepSeek-V3 with an MTP layer answers every
protocol's greedy requests with the plain server's text and usage, over a conversation whose turns reuse the
cached history, and concurrent requests still answer as each does alone."""

from __future__ import annotations

import concurrent.futures
import json

import anthropic
import openai
import pytest

try:  # the HTTP client the SDKs themselves use
    import httpx2 as httpx
except ImportError:
    import httpx

from freetoken.engine.loader import load_model
from support.checkpoints import write_hf_checkpoint
from support.mtp_checkpoints import add_mtp_layer
from support.servers import start_server

TURNS = ["Hello there", "Tell me more", "And then?"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v3_mtp")
    add_mtp_layer(path, write_hf_checkpoint("deepseek_v3", path))
    config = json.loads((path / "config.json").read_text())  # room for a few turns of the chat template
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    plain = start_server(load_model(path, progress=False), "tiny")
    speculative = start_server(load_model(path, progress=False, mtp=True), "tiny", speculative=True)
    yield plain, speculative
    plain.stop()
    speculative.stop()


def _conversation(url: str) -> list[tuple[str, int, int]]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    messages, out = [], []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
        text = r.choices[0].message.content
        messages.append({"role": "assistant", "content": text})
        out.append((text, r.usage.completion_tokens, r.usage.prompt_tokens_details.cached_tokens))
    return out


def test_a_speculative_server_answers_as_the_plain_one(servers):
    plain, speculative = servers
    expected = _conversation(plain.url)
    assert _conversation(speculative.url) == expected
    assert any(cached for _, _, cached in expected[1:])  # later turns reused the history
    drafts = httpx.get(f"{speculative.url}/v1/stats").json()["drafts"]
    assert drafts["proposed"] > 0 and 0 <= drafts["accepted"] <= drafts["proposed"]
    assert httpx.get(f"{plain.url}/v1/stats").json()["drafts"] is None

    def message(url: str) -> str:
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        r = client.messages.create(model="tiny", max_tokens=12, extra_body={"temperature": 0},
                                   messages=[{"role": "user", "content": "Stream this"}])
        return r.content[0].text

    assert message(speculative.url) == message(plain.url)


def test_concurrent_requests_to_a_speculative_server(servers):
    plain, speculative = servers

    def ask(url: str, text: str) -> str:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}],
                                           max_tokens=10, temperature=0)
        return r.choices[0].message.content

    texts = ["one", "two two", "three three three"]
    expected = [ask(plain.url, t) for t in texts]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        assert list(pool.map(lambda t: ask(speculative.url, t), texts)) == expected
