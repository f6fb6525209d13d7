"""The `locoswarm` command: the one entry point above the node and the coordinator."""
