"""What a network lab run may leave in the root namespace, read before and after it: the tests of
tools/netlab assert that nothing the lab made is left (namespaces, links, nftables rules)."""

import subprocess

from tools.netlab.topology import lab_namespaces


def _links() -> list[str]:
    return subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout.splitlines()


def root_links() -> set[str]:
    """The root namespace's link names."""
    return {line.split(":")[1].strip().split("@")[0] for line in _links()}


def root_rules() -> str:
    """The root namespace's nftables ruleset (iptables-nft rules included)."""
    return subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True, check=True).stdout


def left_behind(prefix: str) -> list[str]:
    """The lab's namespaces and links still there, by the run's name prefix."""
    return lab_namespaces(prefix) + [line for line in _links() if prefix in line]
