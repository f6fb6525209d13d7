"""The hash tree an applied report carries (`node.round.coordinator_client.wire_tree`): it
round-trips to the node's tree, a report whose tree does not hash to its digest is refused, a tree
over the protocol's bounds is not sent, and the client sends the tree only with its own digest."""

from __future__ import annotations

import asyncio
import json

import httpx
import pydantic
import pytest

from node.round.coordinator_client import CoordinatorClient, wire_tree
from node.training.model import build_model
from node.training.params import param_tree
from protocol.digest import CHUNK_BYTES, LEAF_BYTES, Tree, encode_header, tree_of
from protocol.http import MAX_TREE_HEADER_BYTES, MAX_TREE_LEAVES, AppliedRequest, AppliedResponse
from protocol.signing import PeerKey

pytestmark = pytest.mark.timeout(60)


def _body_tree(num_bytes: int = 2 * CHUNK_BYTES + 12345, fill: int = 7) -> Tree:
    """The tree of a body of `num_bytes` bytes (three chunks by default, the last one short)."""
    header = encode_header([("w", "torch.uint8", (num_bytes,))])
    return tree_of(header, [bytes([fill]) * num_bytes])


@pytest.mark.parametrize(
    "tree",
    [_body_tree(), param_tree(build_model("tiny", 0)), _body_tree(0)],
    ids=["three-chunks", "tiny-model", "empty-body"],
)
def test_the_wire_tree_round_trips_to_the_digest(tree):
    wire = wire_tree(tree)
    assert wire is not None and wire.tree() == tree and wire.tree().hex == tree.hex
    request = AppliedRequest(params_digest=tree.hex, tree=wire)
    again = AppliedRequest.model_validate_json(request.model_dump_json())
    assert again.tree.tree().hex == tree.hex
    assert len(again.tree.leaf_hex()) == len(tree.leaves)


def test_a_tree_that_does_not_hash_to_the_digest_is_refused():
    tree, other = _body_tree(fill=7), _body_tree(fill=8)
    with pytest.raises(pydantic.ValidationError, match="not params_digest"):
        AppliedRequest(params_digest=other.hex, tree=wire_tree(tree))
    # Leaves that do not fit the body's length make no tree at all.
    short = wire_tree(tree).model_copy(update={"body_bytes": CHUNK_BYTES})
    with pytest.raises(pydantic.ValidationError, match="tree:"):
        AppliedRequest.model_validate({"params_digest": tree.hex, "tree": short.model_dump()})


def test_trees_over_the_protocol_bounds_are_not_sent():
    leaf = b"\x01" * LEAF_BYTES
    at_most = Tree(b"h", MAX_TREE_LEAVES * CHUNK_BYTES, (leaf,) * MAX_TREE_LEAVES)
    assert wire_tree(at_most) is not None
    assert AppliedRequest(params_digest=at_most.hex, tree=wire_tree(at_most)).tree is not None
    too_many = Tree(b"h", MAX_TREE_LEAVES * CHUNK_BYTES + 1, (leaf,) * (MAX_TREE_LEAVES + 1))
    assert wire_tree(too_many) is None
    assert wire_tree(Tree(b"h" * MAX_TREE_HEADER_BYTES, 1, (leaf,))) is not None
    assert wire_tree(Tree(b"h" * (MAX_TREE_HEADER_BYTES + 1), 1, (leaf,))) is None


def _recording_client(bodies: list[dict]) -> CoordinatorClient:
    """A client whose every call lands in `bodies` (as JSON) and is answered as an agreeing report."""

    def answer(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(
            200,
            json=AppliedResponse(
                round=0, majority_digest=bodies[-1]["params_digest"], agrees=True, num_reports=1
            ).model_dump(),
        )

    client = CoordinatorClient(
        "http://coordinator.test", PeerKey.from_seed(b"tree"), transport=httpx.MockTransport(answer)
    )
    client.run_id = "run"
    return client


def test_the_client_sends_the_tree_only_with_the_digest_it_hashes_to():
    tree, other = _body_tree(fill=7), _body_tree(fill=8)
    bodies: list[dict] = []

    async def report() -> None:
        client = _recording_client(bodies)
        try:
            await client.applied(0, tree.hex, tree=tree)
            await client.applied(0, other.hex, tree=tree)  # a tree kept from before the digest moved
            await client.applied(0, tree.hex)
        finally:
            await client.close()

    asyncio.run(report())
    sent, stale, none = bodies
    assert AppliedRequest.model_validate(sent).tree.tree() == tree
    assert stale["tree"] is None and stale["params_digest"] == other.hex
    assert none["tree"] is None
