"""Schema conformance: Schemathesis holds a real `coordinator serve` process to its own OpenAPI
document, operation by operation, with a small fixed budget of examples.

Every check Schemathesis runs by default applies: no 5xx, every status and content type documented,
every answer valid against its documented schema (refusals against ErrorBody, 422 included), a
request the schema admits is never refused as invalid (nor for its size) and one it does not admit
is refused, and a 405 names what the path takes in ``Allow``.

Requests are signed as one of the run's members (the signature covers the exact bytes sent), and
carry the admin token, so that the generated bodies reach the round rules instead of stopping at
authentication; where a generated value is valid, the run id becomes the run's own and a join's
key the signer's. Long-poll waits are cut to a few milliseconds. Hostile input (bad signatures,
raw bytes, garbage headers) is test_coordinator_fuzz.py's job; this file is about the contract.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import unquote, urlsplit

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
requests = pytest.importorskip("requests")

from hypothesis import HealthCheck, given, reject, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402

from protocol.http import sign_request  # noqa: E402
from tests.fixtures.coordinator import ADMIN_HEADERS, SignedPeer, create_run  # noqa: E402
from tests.integration.coordinator_process import CoordinatorProcess, launch_coordinator  # noqa: E402

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

MAX_EXAMPLES = 16  # per operation; the document has ~17 operations
RUN_ID = re.compile(r"^[a-z0-9][a-z0-9-]{0,63}$")
HEX_KEY = re.compile(r"^[0-9a-f]{64}$")
NUM_MEMBERS = 4  # signed calls rotate over them, each under the per-peer rate limit


class SignAs(requests.auth.AuthBase):
    """Signs the prepared request, whose body is final here, as `member`."""

    def __init__(self, member: SignedPeer):
        self.member = member

    def __call__(self, prepared: Any) -> Any:
        body = prepared.body or b""
        if isinstance(body, str):
            body = body.encode()
        # The server verifies the decoded path (the ASGI scope's), so that is what is signed.
        path = unquote(urlsplit(prepared.url).path)
        prepared.headers.update(sign_request(self.member.key, prepared.method, path, body))
        return prepared


class Target:
    def __init__(self, coordinator: CoordinatorProcess, run_id: str, members: list[SignedPeer]):
        self.coordinator = coordinator
        self.run_id = run_id
        self.members = itertools.cycle(members)
        self.session = requests.Session()
        self.session.headers.update(ADMIN_HEADERS)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    work: Path = tmp_path_factory.mktemp("schemathesis")
    coordinator = launch_coordinator(work / "coordinator.db", work / "serve.log")
    try:
        with httpx.Client(base_url=coordinator.url, timeout=10) as client:
            run_id = create_run(
                client,
                {
                    "membership.min_peers": 1,
                    "membership.heartbeat_timeout_s": 3600.0,
                    "exchange.max_packet_bytes": 1 << 20,
                },
            )
            members = [SignedPeer(client) for _ in range(NUM_MEMBERS)]
            for member in members:
                assert member.join(run_id).status_code == 200
        target = Target(coordinator, run_id, members)
        yield target
        target.session.close()
    finally:
        coordinator.stop()
    log = coordinator.log_path.read_text()
    assert "Traceback" not in log, log[-3000:]


def _aim_at_the_run(case: Any, target: Target, member: SignedPeer) -> None:
    """Valid values stay valid: only a valid run id, wait or key is replaced."""
    run_id = (case.path_parameters or {}).get("run_id")
    if isinstance(run_id, str) and RUN_ID.match(run_id) and not case.path.endswith("/close"):
        case.path_parameters["run_id"] = target.run_id
    wait_s = (case.query or {}).get("wait_s")
    if isinstance(wait_s, (int, float)) and not isinstance(wait_s, bool) and 0 <= wait_s <= 60:
        case.query["wait_s"] = min(wait_s, 0.01)
    if case.path.endswith("/join") and isinstance(case.body, dict):
        if isinstance(case.body.get("public_key"), str) and HEX_KEY.match(case.body["public_key"]):
            case.body["public_key"] = member.key.public_hex


def _unstated_rule(case: Any, response: Any) -> bool:
    """Whether a 422 comes from a rule JSON Schema cannot state, so that no generator can know a
    value breaks it: a rule between fields (a model validator, which pydantic words "Value error,"),
    or, for a run config, any refusal of `RunConfig` itself or of the service (``invalid_config``).
    The run config has several such rules (protocol/run_config.py): its document admits what the
    model refuses until they are written into its JSON Schema."""
    if "Value error, " in response.text:
        return True
    if case.path != "/v1/runs" or not isinstance(case.body, dict):
        return False
    if response.json().get("error") == "invalid_config":
        return True
    from pydantic import ValidationError

    from coordinator.routes import json_number
    from protocol.run_config import RunConfig

    try:
        RunConfig.model_validate(json.loads(json.dumps(case.body), parse_float=json_number))
    except ValidationError:
        return True
    return False


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_the_coordinator_keeps_to_its_openapi_document(target: Target, mode: str) -> None:
    # Schemathesis' own pytest plugin (`from_fixture`) does not run under pytest 9; its strategies do.
    from schemathesis.core.failures import FailureGroup
    from schemathesis.generation.modes import GenerationMode

    api = schemathesis.openapi.from_url(f"{target.coordinator.url}/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) >= 13
    failures: dict[str, str] = {}
    statuses: dict[str, set[int]] = {}
    unstated: dict[str, set[str]] = {}
    for operation in operations:
        if mode == "negative" and not (operation.body or any(True for _ in operation.iter_parameters())):
            continue  # nothing in the request to get wrong

        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(generation_mode=GenerationMode(mode)))
        def check(case: Any) -> None:
            member = next(target.members)
            _aim_at_the_run(case, target, member)
            auth = SignAs(member)
            response = case.call(session=target.session, auth=auth, timeout=30)
            statuses.setdefault(operation.label, set()).add(response.status_code)  # noqa: B023 (run in this iteration)
            if mode == "positive" and response.status_code == 422 and _unstated_rule(case, response):
                # A rule the document does not state (see `_unstated_rule`): shown below, not failed.
                unstated.setdefault(operation.label, set()).add(response.json()["detail"][:200])  # noqa: B023
                reject()
            case.validate_response(response, transport_kwargs={"session": target.session, "auth": auth})

        try:
            check()
        except Unsatisfiable:
            pass  # every example broke an unstated rule (listed below)
        except (Exception, FailureGroup) as e:  # every operation gets its turn; failures are reported together
            failures[operation.label] = str(e)[-3000:]
    for label, details in sorted(unstated.items()):
        for detail in sorted(details):
            print(f"{label}: a body the document admits broke a rule it does not state: {detail}")
    assert not failures, "\n\n".join(f"{label}:\n{text}" for label, text in failures.items())
    answered = set().union(*statuses.values())
    assert all(status < 500 for status in answered), statuses
    if mode == "positive":
        assert any(200 <= status < 300 for status in answered), statuses


# -- the conformance failures an outsider's Schemathesis run found, one by one -----------------------


def test_a_405_names_the_methods_the_path_takes(target: Target) -> None:
    with httpx.Client(base_url=target.coordinator.url, timeout=10) as client:
        runs = client.request("TRACE", "/v1/runs")
        heartbeat = client.delete(f"/v1/runs/{target.run_id}/heartbeat")
    assert runs.status_code == 405 and runs.headers["allow"] == "GET, HEAD, POST"
    assert heartbeat.status_code == 405 and heartbeat.headers["allow"] == "POST"
    assert heartbeat.json()["error"] == "method_not_allowed"


def test_a_valid_run_config_over_the_default_body_limit_is_taken_from_the_admin(target: Target) -> None:
    from tests.fixtures.coordinator import run_config

    config = run_config(
        {"membership.join_policy": "token", "membership.join_tokens": [f"{i:08d}" * 32 for i in range(300)]}
    )
    body = json.dumps(config)
    assert len(body) > 64 * 1024
    headers = {"Content-Type": "application/json"}
    with httpx.Client(base_url=target.coordinator.url, timeout=10) as client:
        created = client.post("/v1/runs", content=body, headers={**headers, **ADMIN_HEADERS})
        anonymous = client.post("/v1/runs", content=body, headers=headers)
    assert created.status_code == 200, created.text
    # Without the admin token the default limit holds: nobody else makes the coordinator buffer it.
    assert anonymous.status_code == 413 and anonymous.json()["error"] == "body_too_large"


def test_the_document_states_the_refusals_it_answers(target: Target) -> None:
    with httpx.Client(base_url=target.coordinator.url, timeout=10) as client:
        document = client.get("/openapi.json").json()
        too_long = client.get("/", params={"run": "r" * 65})
    components = document["components"]["schemas"]
    assert "HTTPValidationError" not in components and "ValidationError" not in components
    for path, item in document["paths"].items():
        for method, operation in item.items():
            if "422" in operation["responses"]:
                assert "ErrorBody" in json.dumps(operation["responses"]["422"]), (method, path)
    assert too_long.status_code == 422 and set(too_long.json()) == {"error", "detail"}
    for keyed_by_peer in ("refused", "scores"):
        field = components["AppliedRequest"]["properties"][keyed_by_peer]
        assert field["additionalProperties"] is False and list(field["patternProperties"]) == ["^p[0-9a-f]{16}$"]


def test_integers_are_integers_as_the_document_says(target: Target) -> None:
    """A path or query integer is written in digits; a JSON body's integer is a JSON number with
    no fraction (``2.0`` is the integer 2, as JSON Schema counts it), never a string."""
    member = next(target.members)
    with httpx.Client(base_url=target.coordinator.url, timeout=10) as client:
        member.client = client
        assert member.join(target.run_id).status_code == 200  # the fuzzing may have made it leave
        status = f"/v1/runs/{target.run_id}/status"
        assert client.get(status, params={"history": "2"}).status_code == 200
        for spelled in ("2.0", "2.5", "+2", " 2", "1e1"):
            refused = client.get(status, params={"history": spelled})
            assert refused.status_code == 422, (spelled, refused.text)
        assert client.get(f"/v1/runs/{target.run_id}/rounds/0.0").status_code == 422
        heartbeat = f"/v1/runs/{target.run_id}/heartbeat"
        assert member.post(heartbeat, {"round": 0.0, "state": "training"}).status_code == 200
        for bad in (0.5, "0", True):
            refused = member.post(heartbeat, {"round": bad, "state": "training"})
            assert refused.status_code == 422 and refused.json()["error"] == "invalid_request", (bad, refused.text)
