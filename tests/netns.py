"""Network namespaces for the tests that need a second "host": `ip` and the
check whether this machine can make namespaces and veth pairs
(tests/test_netns.py, tests/test_exposure.py)."""

import os
import shutil
import subprocess


def ip(*args, check=True):
    """Run iproute2's `ip ARGS`; CompletedProcess with text output."""
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def why_not(prefix: str):
    """Why this machine cannot run namespace tests (None: it can). `prefix`
    names the probe namespace and veth pair (<= 12 characters)."""
    if os.geteuid() != 0:
        return "network namespaces and veth links need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    name = f"{prefix}probe"
    made = ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    try:
        veth = ip("-n", name, "link", "add", f"{prefix}p0", "type", "veth",
                  "peer", "name", f"{prefix}p1", check=False)
        if veth.returncode != 0:
            return f"cannot create a veth pair: {veth.stderr.strip()}"
    finally:
        ip("netns", "del", name, check=False)   # takes the veth pair with it
    return None
