"""Property-based fuzzing of the live server from its own OpenAPI schema (schemathesis).

Bounded and derandomized, so it runs in the default pytest invocation and never flakes:
valid and invalid requests alike must never produce a 5xx, invalid ones must be refused
with a 4xx, and every status must be one the schema documents.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import negative_data_rejection, status_code_conformance

from test_server import live_server, model_pair

EXAMPLES = 40  # per generation mode

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    # A short context keeps every accepted request cheap, whatever max_tokens the fuzzer picks.
    pair = model_pair(tmp_path_factory.mktemp("schema_models"))
    with live_server(pair, max_batch=4, max_queue=16, max_model_len=48) as (base, _, _):
        yield base


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzzed_requests_never_get_a_server_error(url, mode):
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    checks = [not_a_server_error, status_code_conformance]
    if mode is GenerationMode.NEGATIVE:
        checks.append(negative_data_rejection)

    @given(case=schema.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(case):
        response = case.call(base_url=url, timeout=60)
        case.validate_response(response, checks=checks)

    fuzz()
    # Still serving normally afterwards.
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
