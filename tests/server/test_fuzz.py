"""A bounded schemathesis pass over the server's OpenAPI schema: whatever the request, never a 5xx.

Bodies are generated from each route's documented schema (valid and mutated), against the app with a tiny
random MoE model (in process, through ASGI); the server must answer every one in the 2xx-4xx range."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from freetoken.engine.loader import load_model  # noqa: E402
from freetoken.server.app import create_app  # noqa: E402
from freetoken.server.engine import ServingEngine  # noqa: E402
from support.checkpoints import PARITY_CASES, write_hf_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz_model")
    write_hf_checkpoint(path=path, **PARITY_CASES["qwen3_moe"])
    engine = ServingEngine(load_model(path, progress=False), "tiny", max_seq_len=96)
    yield schemathesis.openapi.from_asgi("/openapi.json", create_app(engine))
    engine.close()


def test_no_request_gets_a_server_error(api_schema):
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/messages", "/v1/responses"}
    for op in operations:  # each route in turn (schemathesis's pytest plugin does not load on this pytest)

        @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=op.as_strategy())
        def check(case):
            case.call_and_validate(checks=[not_a_server_error])

        check()
