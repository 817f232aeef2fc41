"""A bounded property-based run of every operation of the API against its own OpenAPI spec
(schemathesis): a few generated requests each, and every answer, errors included, has a
status the spec declares for that operation and a body of the schema it gives (OpenAI's error,
Anthropic's under /v1/messages); no server error but a declared 503.

Its backing is a real Redis and no worker: the operations that read and write Redis run for
real, and the queue is full (GENQ_MAX_QUEUED_JOBS=0), so a generation request that passes its
checks is answered 429 at once rather than waiting for a worker. Every optional router
(LoRA loading, dev mode) is on.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from api.main import create_app
from api.settings import Settings
from producer.redis_server import RedisServer

EXAMPLES_PER_OPERATION = 4  # about 30 s for every operation on a slow machine
SETTINGS = dict(max_queued_jobs=0, allow_runtime_lora_updating=True, server_dev_mode=True, request_timeout_s=5.0)
CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance]

# the spec as the app serves it (the same Settings: the optional routers are on)
schema = schemathesis.openapi.from_dict(create_app(Settings(**SETTINGS)).openapi())


@pytest.fixture(scope="module")
def api(serve_api) -> Iterator[tuple[str, requests.Session]]:
    with RedisServer() as server, serve_api(Settings(redis_url=server.url, **SETTINGS)) as url:
        with requests.Session() as session:
            yield url, session


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck), derandomize=True)
def test_every_operation_answers_as_its_spec_says(case: schemathesis.Case, api: tuple[str, requests.Session]) -> None:
    url, session = api
    response = case.call(base_url=url, session=session, timeout=15)
    declared = case.operation.definition.raw.get("responses", {})
    assert response.status_code < 500 or (response.status_code == 503 and "503" in declared), (
        f"{case.method} {case.formatted_path}: {response.status_code} {response.text[:500]}")
    case.validate_response(response, checks=CHECKS)
