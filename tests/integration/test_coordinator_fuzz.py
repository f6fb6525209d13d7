"""Schema fuzz: requests generated from the coordinator's own OpenAPI document, sent to a real
`coordinator serve` process, must never get a 5xx, and every refusal must be the JSON error shape
with a code from `protocol.http.ErrorCode`.

Hypothesis builds each request from an operation in the schema: path parameters that are valid
or not, bodies drawn from the request model's JSON schema (so many pass validation and reach the
round logic) or arbitrary JSON or raw bytes, and headers that are correctly signed by a member,
signed by nobody, or carry the admin token.
"""

from __future__ import annotations

import json
from typing import get_args
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.http import ErrorCode, sign_request
from tests.fixtures.coordinator import ADMIN_HEADERS, SignedPeer, create_run
from tests.integration.coordinator_process import launch_coordinator

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

JSON_LEAVES = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
ANY_JSON = st.recursive(
    JSON_LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


def from_schema(schema: dict, components: dict, depth: int = 0) -> st.SearchStrategy:
    """A strategy for JSON values matching (mostly) a pydantic-generated JSON schema."""
    if depth > 6:
        return JSON_LEAVES
    if "$ref" in schema:
        return from_schema(components[schema["$ref"].rsplit("/", 1)[-1]], components, depth + 1)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(s, components, depth + 1) for s in schema[key]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        properties = schema.get("properties", {})
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {k: from_schema(v, components, depth + 1) for k, v in properties.items() if k in required},
            optional={k: from_schema(v, components, depth + 1) for k, v in properties.items() if k not in required},
        )
    if kind == "array":
        if "prefixItems" in schema:
            return st.tuples(*[from_schema(s, components, depth + 1) for s in schema["prefixItems"]]).map(list)
        items = from_schema(schema.get("items", {}), components, depth + 1)
        return st.lists(items, max_size=min(schema.get("maxItems", 3), 3))
    if kind == "string":
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True).filter(lambda s: len(s) < 300)
        return st.text(max_size=min(schema.get("maxLength", 40), 40))
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        high = schema.get("maximum", schema.get("exclusiveMaximum"))
        return st.floats(
            low,
            high,
            allow_nan=False,
            allow_infinity=False,
            exclude_min="exclusiveMinimum" in schema,
            exclude_max="exclusiveMaximum" in schema,
        )
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return ANY_JSON


@pytest.fixture(scope="module")
def fuzz_target(tmp_path_factory):
    work = tmp_path_factory.mktemp("fuzz")
    coordinator = launch_coordinator(work / "coordinator.db", work / "serve.log")
    client = httpx.Client(base_url=coordinator.url, timeout=10)
    try:
        run_id = create_run(client, {"membership.min_peers": 1, "exchange.max_packet_bytes": 1 << 20})
        member = SignedPeer(client)
        assert member.join(run_id).status_code == 200
        schema = client.get("/openapi.json").json()
        yield client, run_id, member, schema
    finally:
        client.close()
        coordinator.stop()


def operations(schema: dict) -> list[tuple[str, str, dict]]:
    return [(path, method, op) for path, item in sorted(schema["paths"].items()) for method, op in sorted(item.items())]


@st.composite
def requests_for(draw, schema: dict, run_id: str, member: SignedPeer):
    components = schema["components"]["schemas"]
    path, method, operation = draw(st.sampled_from(operations(schema)))
    query: dict[str, object] = {}
    for parameter in operation.get("parameters", []):
        name, location = parameter["name"], parameter["in"]
        if location == "path":
            if name == "run_id":
                value = draw(st.just(run_id) | st.text(max_size=12) | st.just("run-" + "0" * 10))
            else:
                value = draw(st.integers(0, 4) | st.integers() | st.text(max_size=6))
            path = path.replace("{" + name + "}", quote(str(value), safe="") or "x")
        elif location == "query" and draw(st.booleans()):
            # A valid long-poll time would make the fuzzer wait: keep valid ones tiny.
            valid = st.floats(0, 0.05) if name == "wait_s" else st.text(max_size=10)
            query[name] = draw(valid | st.floats(allow_nan=True) | st.text(max_size=8))
    body: bytes = b""
    if method in ("post", "put"):
        content = operation.get("requestBody", {}).get("content", {}).get("application/json")
        model = from_schema(content["schema"], components) if content else ANY_JSON
        kind = draw(st.sampled_from(["model", "model", "json", "bytes", "empty"]))
        if kind == "model":
            body = json.dumps(draw(model)).encode()
        elif kind == "json":
            body = json.dumps(draw(ANY_JSON)).encode()
        elif kind == "bytes":
            body = draw(st.binary(max_size=64))
    auth = draw(st.sampled_from(["signed", "signed", "admin", "none", "garbage"]))
    headers = {"Content-Type": "application/json"}
    if auth == "signed":
        headers.update(sign_request(member.key, method.upper(), path, body))
    elif auth == "admin":
        headers.update(ADMIN_HEADERS)
    elif auth == "garbage":
        headers.update(
            {
                "X-Locoswarm-Peer": draw(st.text("p0123456789abcdef", max_size=20)),
                "X-Locoswarm-Nonce": draw(st.text("0123456789-", max_size=25)),
                "X-Locoswarm-Signature": draw(st.text("0123456789abcdefXYZ", max_size=140)),
            }
        )
    return method, path, query, body, headers


def test_openapi_schema_fuzz_finds_no_server_errors(fuzz_target):
    client, run_id, member, schema = fuzz_target
    assert len(operations(schema)) >= 13
    seen_statuses: set[int] = set()

    @settings(
        max_examples=400,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(requests_for(schema, run_id, member))
    def check(request):
        method, path, query, body, headers = request
        response = client.request(method.upper(), path, params=query, content=body, headers=headers)
        seen_statuses.add(response.status_code)
        assert response.status_code < 500, (method, path, query, body[:200], response.text)
        if response.status_code >= 400:
            error = response.json()
            assert set(error) == {"error", "detail"} and error["error"] in get_args(ErrorCode)

    check()
    assert any(200 <= s < 300 for s in seen_statuses) and any(400 <= s < 500 for s in seen_statuses)
    assert client.get("/healthz").status_code == 200
