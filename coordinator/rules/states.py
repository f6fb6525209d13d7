"""A run's states (`RunRow.state`): waiting for its first peers, running its rounds, finished (its
last round closed) or closed by its operator. Apart from the rules that move a run between them
(coordinator/rules/runs.py, rounds.py), so that any rule can ask without importing those."""

ACTIVE_STATES = ("waiting", "running")  # rounds open and close, peers join
ENDED_STATES = ("finished", "closed")  # nothing opens again; the last rounds' votes still count
