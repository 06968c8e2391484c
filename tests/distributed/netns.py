"""Two "hosts" on one machine for the multi-node tests: this machine's own network namespace
(host 0) and a new one (host 1), joined by a veth pair with an address at each end. Processes
of host 1 run under `ip netns exec`; each host's gloo uses its end of the link
(GLOO_SOCKET_IFNAME), so every byte between the ranks crosses the veth pair, which a test can
take down and bring back up. Needs root (CAP_NET_ADMIN) and iproute2; skipped otherwise."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass

import pytest

SUBNET = "10.231.17"  # a private /30 of the tests' own: .1 is host 0, .2 is host 1


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@dataclass(frozen=True)
class TwoHosts:
    netns: str  # host 1's namespace
    links: tuple[str, str]  # each host's end of the veth pair
    addrs: tuple[str, str] = (f"{SUBNET}.1", f"{SUBNET}.2")

    def command(self, host: int, argv: list[str]) -> list[str]:
        """`argv` run on `host`, its gloo on its end of the link, on its own half of this
        machine's cores (two hosts do not share cores: their compute threads would wait on
        each other's)."""
        env = ["env", f"GLOO_SOCKET_IFNAME={self.links[host]}"]
        prefix = ["ip", "netns", "exec", self.netns] if host == 1 else []
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) > 1:
            half = cpus[: len(cpus) // 2] if host == 0 else cpus[len(cpus) // 2 :]
            prefix = [*prefix, "taskset", "-c", ",".join(map(str, half))]
        return [*prefix, *env, *argv]

    def set_link(self, up: bool) -> None:
        """Take the link down (both ends: nothing passes either way) or bring it back."""
        state = "up" if up else "down"
        _ip("link", "set", self.links[0], state)
        _ip("-n", self.netns, "link", "set", self.links[1], state)


@contextlib.contextmanager
def two_hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 (ip)")
    tag = f"pdl{os.getpid() % 100000}"
    hosts = TwoHosts(f"{tag}-h1", (f"{tag}a", f"{tag}b"))
    try:
        _ip("netns", "add", hosts.netns)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot make a network namespace here: {e.stderr.strip()}")
    try:
        a, b = hosts.links
        _ip("link", "add", a, "type", "veth", "peer", "name", b)
        _ip("link", "set", b, "netns", hosts.netns)
        _ip("addr", "add", f"{hosts.addrs[0]}/30", "dev", a)
        _ip("-n", hosts.netns, "addr", "add", f"{hosts.addrs[1]}/30", "dev", b)
        _ip("-n", hosts.netns, "link", "set", "lo", "up")
        hosts.set_link(True)
        yield hosts
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", hosts.links[0])  # its peer goes with it
        _ip("netns", "del", hosts.netns)
