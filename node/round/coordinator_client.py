"""The node's client of the coordinator: signed requests, typed refusals, retries with backoff.

Every peer call is signed with the peer key (protocol.http.sign_request, a fresh nonce per
attempt). Transport failures, 5xx and 429 answers are retried with exponential backoff (capped
at RETRY_DELAY_MAX_S) and jitter: by default for as long as it takes, so a node rides out a
coordinator outage of any length with its state and its exchange intact; a call that must not
wait (a heartbeat, leaving) passes its own `retry_for_s` and gets `CoordinatorUnavailable` after
it. An outage is logged when it starts, once a minute while it lasts (`coordinator unreachable
for 3m20s; retrying`), and when it ends, however many calls are waiting on it. When one call gets
through, the others waiting out the outage retry at once instead of at the end of their backoff (a
node's report would otherwise arrive up to RETRY_DELAY_MAX_S late, and miss the next round). Before the
coordinator has answered this client even once, a wrong address is the likelier cause than an
outage: those calls give up after FIRST_CONTACT_S with `CoordinatorUnreachable`, whose message
says to check the address. A 429 (over a rate, e.g. too many new keys joining from one address) is
retried no sooner than its ``Retry-After`` says. A 4xx refusal is final and raised as `Refused`,
with the coordinator's error code as a `Code` and what the node does about it, the `Action` of
node/round/refusals.py's table, on which the round loop decides. Every failed call raises a
`CoordinatorCallFailed`.

Joining a run that asks new keys for proof of work (``membership.join_pow_bits``): `join` fetches
the run's challenge, solves it in a worker thread (protocol/join_pow.py) and joins with the proof;
a key that joined the run before rejoins without one.

An applied report carries the hash tree of the digest it names (`wire_tree`; none for a model over
the protocol's MAX_TREE_LEAVES chunks), so the coordinator can name the chunks in which reports differ.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import random
import ssl
import time

import httpx

from node.round.refusals import Action, Code, action_of, code_of
from protocol.digest import Tree
from protocol.http import (
    API_PREFIX,
    MAX_TREE_HEADER_BYTES,
    MAX_TREE_LEAVES,
    AppliedRequest,
    AppliedResponse,
    HeartbeatRequest,
    HeartbeatResponse,
    JoinChallenge,
    JoinRequest,
    JoinResponse,
    LeaveRequest,
    MissingRequest,
    MissingResponse,
    ParamsTree,
    PeerScoreReport,
    RoundView,
    RunInfo,
    RunList,
    RunStatus,
    SnapshotRecorded,
    SnapshotUploaded,
    SubmitRequest,
    SubmitResponse,
    sign_request,
)
from protocol.join_pow import solve
from protocol.signing import PeerKey

log = logging.getLogger(__name__)

RETRY_DELAY_MAX_S = 10.0  # the backoff's cap between two attempts (before jitter)
RETRY_AFTER_MAX_S = 600.0  # a 429's Retry-After is honoured up to this long
FIRST_CONTACT_S = 20.0  # how long calls wait for a coordinator that has never answered this client
OUTAGE_LOG_EVERY_S = 60.0  # while the coordinator is unreachable, one log line this often


def format_duration(seconds: float) -> str:
    """3m20s, 1h05m, 42s: an outage's length as a person reads it."""
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


class CoordinatorCallFailed(Exception):
    """A call to the coordinator failed: no answer (`CoordinatorUnavailable`) or a refusal (`Refused`)."""


class CoordinatorUnavailable(CoordinatorCallFailed):
    """No answer (or only 5xx/429) for longer than the retry budget."""


class CoordinatorUnreachable(CoordinatorUnavailable):
    """The coordinator never answered this client: most likely a wrong address."""


class Refused(CoordinatorCallFailed):
    """A final 4xx answer: `code`, the coordinator's error code (a `Code`; the plain string of a code
    a newer coordinator sends and this node does not know), and `action`, what the node does."""

    def __init__(self, status: int, code: str, detail: str):
        super().__init__(f"{status} {code}: {detail}")
        self.status, self.detail = status, detail
        self.code: Code | str = code_of(code)
        self.action: Action = action_of(self.code)


class CoordinatorClient:
    """Every call the node makes to the coordinator, each returning the protocol's typed response.

    `transport` replaces the network (tests pass `httpx.ASGITransport(app)` to talk to an
    in-process coordinator app); by default it is httpx's own.
    """

    def __init__(
        self,
        base_url: str,
        key: PeerKey,
        *,
        retry_for_s: float | None = None,
        timeout_s: float = 90.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.key = key
        self.retry_for_s = retry_for_s  # None: retry until the coordinator answers
        self.run_id: str | None = None
        self._unreachable_since: float | None = None  # monotonic time of the outage's first failure
        self._answered = False  # the coordinator has answered this client at least once
        self._outage_logged_at = 0.0
        self._back = asyncio.Event()  # set when the coordinator answers after an outage (a fresh one per outage)
        self._stopping = asyncio.Event()  # `stop_retrying`: the node is stopping
        self._member_of: set[str] = set()  # runs this key joined: a rejoin needs no proof of work
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s, trust_env=False, transport=transport)

    async def close(self) -> None:
        await self._http.aclose()

    def stop_retrying(self) -> None:
        """The node is stopping: a call in an outage tries once more and then gives up
        (`CoordinatorUnavailable`) instead of waiting for the coordinator, so that a volunteer's
        Ctrl+C or an operator's SIGTERM is not held for as long as the outage lasts."""
        self._stopping.set()

    @property
    def unreachable_for_s(self) -> float | None:
        """How long the coordinator has not answered (None: it answered the last call)."""
        return None if self._unreachable_since is None else time.monotonic() - self._unreachable_since

    def _note_failure(self, error: str) -> None:
        now = time.monotonic()
        if self._unreachable_since is None:
            self._unreachable_since = self._outage_logged_at = now
            self._back = asyncio.Event()
            log.warning("coordinator %s unreachable (%s); retrying", self.base_url, error)
        elif now - self._outage_logged_at >= OUTAGE_LOG_EVERY_S:
            self._outage_logged_at = now
            log.warning(
                "coordinator unreachable for %s (%s); retrying", format_duration(now - self._unreachable_since), error
            )

    def _note_answer(self) -> None:
        self._answered = True
        if self._unreachable_since is not None:
            log.warning(
                "coordinator reachable again after %s", format_duration(time.monotonic() - self._unreachable_since)
            )
            self._unreachable_since = None
            self._back.set()  # wakes the calls waiting out the outage

    async def _call(
        self,
        method: str,
        path: str,
        body=None,
        params: dict | None = None,
        signed: bool = True,
        retry_for_s: float | None = None,
    ) -> dict:
        path = API_PREFIX + path
        content = body.model_dump_json().encode() if body is not None else b""
        budget = self.retry_for_s if retry_for_s is None else retry_for_s
        first_contact = not self._answered and (budget is None or budget > FIRST_CONTACT_S)
        if first_contact:
            budget = FIRST_CONTACT_S
        deadline = float("inf") if budget is None else time.monotonic() + budget
        delay_s, last_error, attempts = 0.2, "no attempt", 0  # attempts: failed ones before this
        while True:
            retry_after_s, unreached = 0.0, False
            headers = {"content-type": "application/json"}
            if signed:
                headers |= sign_request(self.key, method, path, content)
            try:
                response = await self._http.request(
                    method, path, content=content or None, params=params, headers=headers
                )
            except httpx.TransportError as e:
                last_error, unreached = f"{type(e).__name__}: {e}", True
                if first_contact and not self._answered and (why := tls_mismatch(e, self.base_url)):
                    raise CoordinatorUnreachable(f"the coordinator at {self.base_url}: {why}") from e
            else:
                if response.status_code < 500:
                    self._note_answer()  # a refusal or a rate limit is an answer, not an outage
                if response.status_code < 400:
                    return response.json()
                if response.status_code < 500 and response.status_code != 429:
                    try:
                        error = response.json()
                    except json.JSONDecodeError:
                        error = {"error": "http_error", "detail": response.text[:200]}
                    raise Refused(response.status_code, str(error.get("error")), str(error.get("detail")))
                last_error = f"HTTP {response.status_code}"
                if response.status_code == 429:
                    retry_after_s = _retry_after_s(response.headers.get("retry-after"))
            if self._stopping.is_set() and attempts:
                raise CoordinatorUnavailable(f"{method} {path}: {last_error} (not retried: this node is stopping)")
            attempts += 1
            if time.monotonic() + max(delay_s, retry_after_s) > deadline:
                if first_contact and not self._answered:
                    raise CoordinatorUnreachable(
                        f"no answer from the coordinator at {self.base_url} in {budget:.0f} s ({last_error}): check "
                        f"the address, or run `locoswarm doctor --coordinator {self.base_url}`"
                    )
                raise CoordinatorUnavailable(f"{method} {path}: {last_error} (gave up after {budget:.0f} s)")
            if last_error != "HTTP 429":
                self._note_failure(last_error)
            # Jitter spreads the retries of many clients; a Retry-After is a floor, never shortened.
            wait_s = max(delay_s * (0.5 + random.random()), retry_after_s * (1.0 + 0.2 * random.random()))
            log.log(
                logging.INFO if retry_after_s else logging.DEBUG,
                "coordinator %s %s: %s; retrying in %.1f s",
                method,
                path,
                last_error,
                wait_s,
            )
            # ...or as soon as another call gets an answer (not after a 5xx or a 429), or the node stops.
            wakers = [asyncio.ensure_future(e.wait()) for e in ([self._back] if unreached else []) + [self._stopping]]
            try:
                await asyncio.wait(wakers, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waker in wakers:
                    waker.cancel()
            delay_s = min(delay_s * 2, RETRY_DELAY_MAX_S)

    async def runs(self) -> RunList:
        return RunList.model_validate(await self._call("GET", "/runs", signed=False))

    async def run_info(self, run_id: str) -> RunInfo:
        return RunInfo.model_validate(await self._call("GET", f"/runs/{run_id}", signed=False))

    async def status(
        self, run_id: str | None = None, retry_for_s: float | None = None, history: int | None = None
    ) -> RunStatus:
        """The run's status; `history`: how many closed rounds it summarizes (default: the
        coordinator's limit, 1000)."""
        return RunStatus.model_validate(
            await self._call(
                "GET",
                f"/runs/{run_id or self.run_id}/status",
                signed=False,
                params={"history": history} if history is not None else None,
                retry_for_s=retry_for_s,
            )
        )

    async def join(
        self,
        run_id: str,
        *,
        join_token: str | None,
        device: str,
        multiaddrs: list[str],
        bandwidth_mbps: float | None = None,
        uplink_mbps: float | None = None,
        state: tuple[int, str] | None = None,
        reachable: bool | None = None,
    ) -> JoinResponse:
        """Join (or rejoin) the run; `state`: (round, digest) of the round start this node holds;
        `reachable` False: its operator says peers cannot dial it (None: the coordinator dials back).
        A new key solves the run's proof of work first when it asks for one."""
        request = JoinRequest(
            public_key=self.key.public_hex,
            join_token=join_token,
            device=device[:256],
            listen_multiaddrs=multiaddrs[:16],
            bandwidth_mbps=bandwidth_mbps,
            uplink_mbps=uplink_mbps,
            state_round=state[0] if state else None,
            state_digest=state[1] if state else None,
            reachable=False if reachable is False else None,
        )
        proof_needed = run_id not in self._member_of
        for attempt in range(3):
            if proof_needed:
                request = await self._with_join_proof(run_id, request)
            try:
                joined = JoinResponse.model_validate(await self._call("POST", f"/runs/{run_id}/join", request))
                break
            except Refused as e:
                # A challenge that expired while it was solved, or a membership the coordinator forgot.
                if e.code is not Code.JOIN_PROOF_REQUIRED or attempt == 2:
                    raise
                proof_needed = True
                log.info("joining %s: %s; solving a fresh challenge", run_id, e.detail)
        self.run_id = joined.run_id
        self._member_of.add(run_id)
        return joined

    async def join_challenge(self, run_id: str) -> JoinChallenge:
        return JoinChallenge.model_validate(await self._call("GET", f"/runs/{run_id}/join-challenge", signed=False))

    async def _with_join_proof(self, run_id: str, request: JoinRequest) -> JoinRequest:
        """The join request with a proof of work, when the run asks for one."""
        try:
            challenge = await self.join_challenge(run_id)
        except Refused as e:
            if e.code is Code.NOT_FOUND:  # a coordinator older than proofs of work asks for none
                return request
            raise
        if challenge.bits == 0:
            return request
        started = time.monotonic()
        nonce = await asyncio.to_thread(solve, run_id, self.key.public_hex, challenge.salt, challenge.bits)
        log.info(
            "joining %s: solved its %d-bit proof of work in %.1f s", run_id, challenge.bits, time.monotonic() - started
        )
        return request.model_copy(update={"pow_salt": challenge.salt, "pow_nonce": nonce})

    async def heartbeat(self, round: int, state: str, **fields) -> HeartbeatResponse:
        request = HeartbeatRequest(round=round, state=state, **fields)
        return HeartbeatResponse.model_validate(
            await self._call("POST", f"/runs/{self.run_id}/heartbeat", request, retry_for_s=5.0)
        )

    async def submit(self, round: int, **fields) -> SubmitResponse:
        request = SubmitRequest(**fields)
        return SubmitResponse.model_validate(
            await self._call("POST", f"/runs/{self.run_id}/rounds/{round}/submit", request)
        )

    async def round(
        self, round: int, wait_s: float = 0.0, submitted_gt: int | None = None, version_gt: int | None = None
    ) -> RoundView:
        """The round's view; with `wait_s`, once it closed (or more than `submitted_gt` packets came,
        or with `version_gt`, once its manifest version is above that)."""
        params = {"wait_s": wait_s} | ({"submitted_gt": submitted_gt} if submitted_gt is not None else {})
        params |= {"version_gt": version_gt} if version_gt is not None else {}
        data = await self._call("GET", f"/runs/{self.run_id}/rounds/{round}", params=params, signed=False)
        return RoundView.model_validate(data)

    async def applied(
        self,
        round: int,
        params_digest: str,
        refused: dict[str, str] | None = None,
        manifest_version: int = 1,
        val_loss: float | None = None,
        scores: dict[str, PeerScoreReport] | None = None,
        sample: str | None = None,
        tree: Tree | None = None,
        snapshot_bytes: int | None = None,
    ) -> AppliedResponse:
        """Report the digest after applying `manifest_version` of round `round`'s manifest. `tree`: the
        hash tree this node holds; it goes with the report when it hashes to `params_digest` and fits
        the protocol's bounds (`wire_tree`), else the report carries none."""
        wire = wire_tree(tree) if tree is not None and tree.hex == params_digest else None
        request = AppliedRequest(
            params_digest=params_digest,
            refused=refused or {},
            manifest_version=manifest_version,
            val_loss=val_loss,
            scores=scores or {},
            sample=sample,
            tree=wire,
            snapshot_bytes=snapshot_bytes,
        )
        return AppliedResponse.model_validate(
            await self._call("POST", f"/runs/{self.run_id}/rounds/{round}/applied", request)
        )

    async def missing(self, round: int, peer_ids: list[str], lost_own: bool = False) -> MissingResponse:
        """Report manifest entries of closed round `round` whose packets could not be fetched, and
        with `lost_own` that this node no longer holds its own packet of that round."""
        request = MissingRequest(peer_ids=peer_ids, lost_own=lost_own)
        return MissingResponse.model_validate(
            await self._call("POST", f"/runs/{self.run_id}/rounds/{round}/missing", request)
        )

    async def snapshot_uploaded(self, round: int, snapshot_digest: str, size_bytes: int) -> SnapshotRecorded:
        """Report the snapshot of round `round` + 1's start put into the packet mirror at the URL the
        answer to this node's applied report of `round` handed it."""
        request = SnapshotUploaded(snapshot_digest=snapshot_digest, size_bytes=size_bytes)
        return SnapshotRecorded.model_validate(
            await self._call("POST", f"/runs/{self.run_id}/rounds/{round}/snapshot", request)
        )

    async def leave(self, reason: str = "left") -> None:
        await self._call("POST", f"/runs/{self.run_id}/leave", LeaveRequest(reason=reason), retry_for_s=3.0)


def wire_tree(tree: Tree) -> ParamsTree | None:
    """`tree` as an applied report carries it (its `.tree()` is `tree` again); None when it has more
    than MAX_TREE_LEAVES leaves or a header over MAX_TREE_HEADER_BYTES (such a node sends no tree)."""
    if len(tree.leaves) > MAX_TREE_LEAVES or len(tree.header) > MAX_TREE_HEADER_BYTES:
        return None
    return ParamsTree(
        header=base64.b64encode(tree.header).decode("ascii"),
        body_bytes=tree.body_bytes,
        leaves=b"".join(tree.leaves).hex(),
    )


def tls_mismatch(error: httpx.TransportError, base_url: str) -> str | None:
    """What is wrong, with its fix, when `error` is a TLS failure that no retry mends (an https://
    URL for a coordinator that speaks plain HTTP, a certificate that does not verify); None otherwise."""
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, ssl.SSLError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return None
    if isinstance(cause, ssl.SSLCertVerificationError):
        return f"its TLS certificate does not verify ({cause.verify_message or cause.reason})"
    if cause.reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "HTTP_REQUEST", "PACKET_LENGTH_TOO_LONG"):
        plain = "http://" + base_url.removeprefix("https://")
        return f"it answers in plain HTTP, not TLS ({cause.reason}): use {plain}"
    return None


def _retry_after_s(value: str | None) -> float:
    """A Retry-After header's delay in seconds (the seconds form; a date or garbage: 0), capped."""
    try:
        return min(RETRY_AFTER_MAX_S, max(0.0, float(value))) if value else 0.0
    except ValueError:
        return 0.0
