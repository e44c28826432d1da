"""Two nodes in network namespaces and one Slipstream cluster across them, shared by the module: node A runs
`slipstream cluster up --host <A's address>`; node B joins with the `ray start --address ...` line that
`cluster up` printed, offering the custom resource `node_b`, its Ray blind to one directory node A has
(`Cluster.private`). Skipped where namespaces cannot be made."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from multinode_cluster import ENV, NODE_B_RESOURCE, NODE_B_UNITS, Cluster
from netns import nodes, unavailable


@pytest.fixture(scope="module")
def cluster():
    if (why := unavailable()) is not None:
        pytest.skip(f"multi-node tests: {why}")
    home = Path(tempfile.mkdtemp(prefix="ssmn-", dir="/tmp"))
    with nodes(2) as (a, b):
        try:
            up = [sys.executable, "-m", "slipstream.cli", "cluster", "up", "--home", str(home)]
            up += ["--host", a.address, "--no-prometheus"]
            out = a.run(up, env=ENV, timeout_s=180).stdout
            c = Cluster(a, b, home, out)
            # node B joins exactly as `cluster up` told the operator to; its Ray sees an empty tmpfs over
            # HOME/private: a directory only node A has
            c.private.mkdir()
            c.join(b, {NODE_B_RESOURCE: NODE_B_UNITS}, hide=True)
            yield c
        finally:
            # the cluster's own way down first (it stops jobs and services by pid); whatever is left in
            # either namespace (node B's Ray, a stuck process) is killed when the namespaces go
            a.run(
                [sys.executable, "-m", "slipstream.cli", "cluster", "down", "--home", str(home), "--force"],
                env=ENV,
                timeout_s=120,
                check=False,
            )
    shutil.rmtree(home, ignore_errors=True)
