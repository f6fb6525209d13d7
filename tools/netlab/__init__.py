"""The network lab: a swarm in network namespaces on shaped links (`python -m tools.netlab`)."""
