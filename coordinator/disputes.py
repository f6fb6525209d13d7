"""Disputes over a round's digest: which chunks differ, who computed what, and the verdict.

Every contributor of round r computes the whole outer step from r's start and r's packets, so
each report is a recomputation of every chunk of the digest's hash tree (protocol/digest.py: a
chunk after round r depends only on that chunk at the start and the manifest's packets). When the
reports on r's latest manifest version name more than one digest, the coordinator (which holds no
tensors) compares the leaf hashes the reports carry (`AppliedRequest.tree`) and names the chunks
each side differs in; the verdict is the digest the votes of credit agreed (coordinator/rules/votes.py,
`tally`: credit is standing earned by useful work, protocol/scoring.py rule 5), and every peer
that applied that version from the agreed start and reported another digest (a vote or not) is
excluded (`wrong_digest`). A made-up digest is backed by no
peer that earned credit, so it is never agreed, however many fresh keys name it.

    record = decide(reports, agreed, credit)     # JSON-able dict, stored on the round (rounds.dispute)
    view = sides(reports, credit, reference)     # the same sides for an undecided round (no verdict)
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

from coordinator.storage import AppliedRow

MAX_CHUNKS_SHOWN = 16  # differing chunk indices kept per side


def sides(reports: Iterable[AppliedRow], credit: Mapping[str, int], reference: str | None) -> list[dict]:
    """The digests the reports name, `reference` first then by credit: each with its peers, their
    credit, and the chunks whose leaves differ from the reference's (None: a side sent no leaves)."""
    by_digest: dict[str, list[AppliedRow]] = {}
    for report in reports:
        by_digest.setdefault(report.params_digest, []).append(report)
    ref_leaves = _leaves(by_digest.get(reference, ()))
    out = []
    for digest, rows in by_digest.items():
        leaves = _leaves(rows)
        if digest == reference:
            chunks: list[int] | None = []
        elif leaves is None or ref_leaves is None:
            chunks = None
        else:
            chunks = _differing(ref_leaves, leaves)
        out.append(
            {
                "digest": digest,
                "peers": sorted(r.peer_id for r in rows),
                "credit": sum(credit.get(r.peer_id, 0) for r in rows),
                "chunks": chunks,
            }
        )
    out.sort(key=lambda side: (side["digest"] != reference, -side["credit"], side["digest"]))
    return out


def decide(reports: list[AppliedRow], agreed: str, credit: Mapping[str, int], previous: Mapping | None = None) -> dict:
    """The record of a round whose votes named more than one digest, once `agreed` is agreed. Votes
    that come later are added to `previous` (the record so far) with the credit its voters had when
    they were first counted: a liar's credit is gone once it is excluded, not before."""
    credit = {**credit, **(previous or {}).get("credits", {})}
    credit = {r.peer_id: credit.get(r.peer_id, 0) for r in reports}
    all_sides = sides(reports, credit, agreed)
    winner, losers = all_sides[0], all_sides[1:]
    excluded = sorted(p for side in losers for p in side["peers"])
    chunks = sorted({c for side in losers for c in side["chunks"] or ()})
    where = f"chunk(s) {_list(chunks)}" if chunks else "its chunks"
    verdict = (
        f"{where} recompute to the agreed leaves by {len(winner['peers'])} peer(s) of credit"
        f" {winner['credit']} ({_list(winner['peers'])}); {len(excluded)} peer(s) of credit"
        f" {sum(side['credit'] for side in losers)} reported another digest: excluded"
    )
    return {"agreed": agreed, "sides": all_sides, "excluded": excluded, "verdict": verdict, "credits": credit}


def reason(record: Mapping, peer_id: str, round_index: int) -> str:
    """Why `peer_id` was excluded, for its standing."""
    side = next(s for s in record["sides"] if peer_id in s["peers"])
    where = f" (chunk(s) {_list(side['chunks'])} differ)" if side["chunks"] else ""
    return (
        f"round {round_index}: it reported digest {side['digest'][:16]}{where}; the peers of credit computed"
        f" {record['agreed'][:16]}"
    )


def voters(record: Mapping) -> set[str]:
    return {p for side in record["sides"] for p in side["peers"]}


def load(text: str | None) -> dict | None:
    return json.loads(text) if text else None


def _leaves(rows: Iterable[AppliedRow]) -> str | None:
    return next((r.leaves for r in rows if r.leaves), None)


def _differing(a: str, b: str) -> list[int]:
    """Indices of the 32-byte leaves (64 hex characters) that differ; a longer tree's extra ones too."""
    n = max(len(a), len(b)) // 64
    out = [i for i in range(n) if a[64 * i : 64 * i + 64] != b[64 * i : 64 * i + 64]]
    return out[:MAX_CHUNKS_SHOWN]


def _list(items: list) -> str:
    return ", ".join(map(str, items[:MAX_CHUNKS_SHOWN])) + (" ..." if len(items) > MAX_CHUNKS_SHOWN else "")
