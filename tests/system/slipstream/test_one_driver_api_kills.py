"""One driver per job, ever, on a real cluster: a control API killed (SIGKILL) at random points of submits
leaves never two drivers for a name, and a state every command accepts."""

from __future__ import annotations

import random
import signal
import threading
import time
from pathlib import Path

import http_calls
import httpx
import psutil
import pytest
from cluster_helpers import ENDED, spec_text, wait_for

from slipstream.cli.jobs import ApiError
from slipstream.cluster import services as cluster
from slipstream.cluster import state as cluster_state
from slipstream.job.store import ACTIVE_STATES


class DriverCensus:
    """Samples the job driver processes of a cluster (a thread, every 50 ms): the most of one name alive
    at once."""

    def __init__(self, home: Path) -> None:
        self.home, self.most = str(home), {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def alive(self) -> dict[str, list[int]]:
        found: dict[str, list[int]] = {}
        for p in psutil.process_iter(["cmdline", "status", "pid"]):
            argv = p.info["cmdline"] or []
            if "slipstream.cluster.job_entry" in argv and self.home in argv and p.info["status"] != "zombie":
                found.setdefault(argv[argv.index("--job") + 1], []).append(p.info["pid"])
        return found

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            for name, pids in self.alive().items():
                if len(pids) > len(self.most.get(name, [])):
                    self.most[name] = pids

    def close(self) -> dict[str, list[int]]:
        self._stop.set()
        self._thread.join()
        return self.most


def _submit_until_killed(info, spec: str, cwd: str) -> None:
    try:
        http_calls.post(
            f"{info.api_url}/jobs",
            headers={"Authorization": f"Bearer {info.api_token}"},
            json={"spec": spec, "cwd": cwd},
            timeout=60,
        )
    except httpx.HTTPError:
        pass  # the API was killed under it


def test_a_control_api_killed_mid_submit_leaves_one_driver_per_name_and_no_stuck_job(
    info, client, tmp_path, tiny_model_dir
):
    home = Path(info.home)
    rng = random.Random(11)
    census = DriverCensus(home)
    seen = []
    for i in range(4):
        name = f"kill-{i % 2}"
        spec = spec_text(tiny_model_dir, name)
        post = threading.Thread(target=_submit_until_killed, args=(info, spec, str(tmp_path)))
        post.start()
        time.sleep(rng.uniform(i, i + 1) * 0.3)  # somewhere in the submit: checks, record, files, Ray
        api = psutil.Process(cluster_state.read_state(home).pids["api"])
        api.send_signal(signal.SIGKILL)
        api.wait(30)  # gone, its port closed, before a new one starts
        post.join()
        cluster.up(home, start_prometheus=False)  # a new control API; it reconciles the jobs at its start
        try:
            st = client.get(name)
        except ApiError as e:  # killed before anything was recorded
            assert "HTTP 404" in str(e), e
            st = {"state": None}
        seen.append(st.get("state"))
        if st["state"] in ACTIVE_STATES:  # Ray has its submission: the name stays taken
            with pytest.raises(ApiError, match="HTTP 409"):
                client.submit(spec, [], str(tmp_path))
        else:  # it never reached Ray (or nothing was recorded): the name is free, no driver started
            assert st["state"] is None or "never started" in st["error"], st
            client.submit(spec, [], str(tmp_path))
        stop = client.stop(name, force=True)
        assert stop["stop"] and f"submission {client.get(name)['ray_job_id']}" in stop["message"], stop
        st = wait_for(client, name, "the forced stop", lambda s: s["state"] in ENDED, ended_ok=True)
        assert st["state"] in ("stopped", "interrupted"), st
        client.remove(name)
    most = census.close()
    print(f"states after the kills: {seen}; most drivers of one name at once: {most}")
    assert all(len(pids) <= 1 for pids in most.values()), most
    deadline = time.monotonic() + 60  # an ended job's driver process is gone soon after
    while census.alive():
        assert time.monotonic() < deadline, census.alive()
        time.sleep(0.2)
