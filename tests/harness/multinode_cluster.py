"""The multi-node harness's cluster: a Slipstream cluster across network-namespace nodes (netns.py), its
environment and node B's custom resource. Test modules import it by this name (not from conftest, whose
module name another tests folder's conftest may hold)."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

from netns import Node

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
NODE_B_RESOURCE = "node_b"
NODE_B_UNITS = 100
"""Units of `node_b` node B offers: each generator actor asks for one (engines, rollout workers)."""


class Cluster:
    """The cluster across nodes `a` (head: Redis, Ray head, control API) and `b` (a Ray worker node)."""

    def __init__(self, a: Node, b: Node, home: Path, up_output: str) -> None:
        self.a, self.b, self.home, self.up_output = a, b, home, up_output
        self.joins = 0
        self.private = home / "private"
        """A directory that node A's processes read and node B's Ray does not see (a tmpfs over it in a
        mount namespace of its own)."""

    @property
    def secrets(self) -> dict[str, str]:
        return json.loads((self.home / "secrets.json").read_text())

    @property
    def ray_env(self) -> dict[str, str]:
        """What a process needs to join this Ray (read when `ray` is imported)."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.secrets["ray_auth_token"]}

    def join(self, node: Node, resources: dict[str, float], num_cpus: int | None = None, hide: bool = False):
        """`node` joins this cluster's Ray with the `ray start --address ...` line that `cluster up` printed,
        offering `resources` (and `num_cpus` CPUs, else what Ray counts); `hide`: its Ray runs in a mount
        namespace of its own with an empty tmpfs over `private`."""
        joined = re.search(r"ray start --address (\S+)", self.up_output)
        assert joined, f"`cluster up` printed no `ray start --address` line:\n{self.up_output}"
        self.joins += 1
        start = [sys.executable, "-m", "ray.scripts.scripts", "start", "--address", joined.group(1)]
        start += ["--resources", json.dumps(resources), "--disable-usage-stats"]
        start += ["--temp-dir", str(self.home / f"ray-{node.name}-{self.joins}")]
        start += ["--num-cpus", str(num_cpus)] if num_cpus is not None else []
        cmd = shlex.join(start)
        if hide:
            cmd = f"mount -t tmpfs none {shlex.quote(str(self.private))} && exec {cmd}"
        node.run(["unshare", "-m", "--propagation", "private", "sh", "-c", cmd], {**ENV, **self.ray_env}, 180)

    def python(self, node: Node, code: str, timeout_s: float = 120.0, env: dict | None = None):
        """Run `code` with this repository's Python in `node`; what its last stdout line says, as JSON."""
        run_env = {**ENV, **(env or {})}
        out = node.run([sys.executable, "-c", code], env=run_env, timeout_s=timeout_s).stdout
        return json.loads(out.strip().splitlines()[-1])

    def cli(self, *args: str, timeout_s: float = 120.0) -> str:
        """`slipstream ARGS --home HOME` in node A; its stdout."""
        cmd = [sys.executable, "-m", "slipstream.cli", *args, "--home", str(self.home)]
        return self.a.run(cmd, env=ENV, timeout_s=timeout_s).stdout

    def alive_nodes(self) -> list[dict]:
        """Ray's view of the cluster, asked from node A: each alive node's address and resources."""
        code = f"""
import json, ray
from slipstream.cluster.state import load_info
info = load_info({str(self.home)!r})
ray.init(address=info.ray_address, logging_level="ERROR", log_to_driver=False)
print(json.dumps([{{"address": n["NodeManagerAddress"], "resources": n["Resources"]}}
                  for n in ray.nodes() if n["Alive"]]))
"""
        return self.python(self.a, code, env=self.ray_env)
