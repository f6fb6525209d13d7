"""`CannotStart`: the one error a node stops on before it trains, carrying the line the volunteer reads.

    raise CannotStart(f"no open run on {url}: ask the operator to create one, or {listing}")

What a volunteer can get wrong is said in one line that names the fix: a bad config value, a
device torch cannot use, a clock too far from the coordinator's, a coordinator that never answers
or refuses the join (node/round/refusals.py), no run to join, a run this node cannot train, data
or initial weights that are not the run's. `locoswarm node join` (node/cli/join.py) prints
`error: <line>` on stderr and exits 2, with a traceback only under `-v`. Anything else that
escapes the node is a bug, and shows its traceback.
"""

from __future__ import annotations


class CannotStart(Exception):
    """This node cannot start (or go on): `str(error)` is one line saying what to do."""
