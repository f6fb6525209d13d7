"""The round's state has one owner (node/round/state.py, docs/design-round.md): its transitions, and
that no other module of the node writes what they write (read from the source, as
tests/unit/test_architecture.py reads imports)."""

from __future__ import annotations

import ast
from pathlib import Path

from node.round.state import Doing, KeptRound, RoundState
from protocol.digest import ChunkHasher, Tree, encode_header

REPO_ROOT = Path(__file__).resolve().parents[2]
OWNER = REPO_ROOT / "node" / "round" / "state.py"


def _tree(data: bytes) -> Tree:
    hasher = ChunkHasher()
    hasher.update(data)
    return Tree(encode_header([("w", "torch.float32", (len(data) // 4,))]), hasher.num_bytes, hasher.finish())


def test_the_parameters_move_only_through_the_transitions():
    fresh, joined = RoundState.at_join(swarm_has_params=False), RoundState.at_join(swarm_has_params=True)
    assert (fresh.params_round, joined.params_round) == (0, None)
    state, tree = RoundState(), _tree(b"\x00" * 16)
    state.applied(3, tree)
    assert (state.params_round, state.digest, state.tree) == (4, tree.hex, tree)
    state.amendments.keep(KeptRound(3, 1, None, {}, {}))
    again = _tree(b"\x01" * 16)
    done = state.recomputed(state.amendments.kept, 2, again)
    assert (done.round, done.from_version, done.to_version, done.digest) == (3, 1, 2, again.hex)
    assert state.params_round == 4 and state.digest == again.hex and state.amendments.applied_versions == {3: 2}
    state.trained(4)
    assert state.params_round == 5
    state.params_unknown()
    assert state.params_round is None
    state.loaded(7, "ab" * 32, None)
    assert (state.params_round, state.digest, state.tree) == (7, "ab" * 32, None)
    assert state.amendments.kept is None and state.amendments.applied_versions == {}, "a snapshot follows no round"
    state.seeded()
    assert state.params_round == 0


def test_the_activity_says_what_the_node_does():
    state = RoundState()
    assert state.activity.state == Doing.JOINING == "joining"
    state.begin(5)
    assert (state.activity.round, state.activity.state, state.activity.inner_step) == (5, "waiting", 0)
    state.activity.inner_step = 3
    state.training()
    assert (state.activity.state, state.activity.inner_step) == ("training", 0)
    state.stuck("round 4: waiting for the packets of p1")
    assert state.activity.state == "stuck" and state.activity.detail.startswith("round 4")
    state.doing(Doing.CATCHING_UP)
    state.clear_detail()
    assert (state.activity.state, state.activity.detail) == ("catching_up", None)


def _writes(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of every assignment to the round state's fields in `tree`."""
    out = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        flat = []
        while targets:
            target = targets.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                targets.extend(target.elts)
            else:
                flat.append(target)
        for target in flat:
            if not isinstance(target, ast.Attribute):
                continue
            owner = target.value.attr if isinstance(target.value, ast.Attribute) else None
            if (
                target.attr == "params_round"
                or (owner == "activity" and target.attr in ("round", "state", "detail"))
                or (owner == "state" and target.attr in ("digest", "tree", "amendments", "activity"))
            ):
                out.append((node.lineno, f"{owner}.{target.attr}" if owner else target.attr))
    return out


def test_nothing_but_the_round_state_writes_it():
    found = []
    for path in sorted((REPO_ROOT / "node").rglob("*.py")):
        if path == OWNER:
            continue
        found += [
            f"{path.relative_to(REPO_ROOT)}:{line}: {what}" for line, what in _writes(ast.parse(path.read_text()))
        ]
    assert found == []


def test_the_finder_finds_a_write():
    source = "s.params_round = 1\ns.state.activity.state, x = 'training', 0\ns.state.digest = ''\ns.activity.inner_step = 1\n"
    assert [what for _, what in _writes(ast.parse(source))] == ["params_round", "activity.state", "state.digest"]
