"""The control API's built-in web page (slipstream/cluster/ui.py) and its JSON route /jobs/NAME/progress: the
HTML and script are served without a token and hold no data; the progress records need the token.
JobControl.progress is checked against a real Redis; the page itself in headless Chromium when one is
installed (the screenshot is kept as docs/ui_status.png)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from slipstream.cluster.api import create_app
from slipstream.cluster.control import ControlError, JobControl
from slipstream.cluster.ui import APP_JS

TOKEN = "t0k3n-for-the-ui-test"
ROOT = Path(__file__).resolve().parents[3]


def records(n: int) -> list[dict]:
    return [
        {
            "version": v,
            "reward_mean": 0.2 + 0.6 * v / n,
            "staleness_mean": (v % 3) / 2,
            "staleness_max": v % 3,
            "tokens_per_s": 900.0 + 15 * v,
            "train_tokens_per_s": 4000.0 + 40 * (v % 5),
            "step_s": 0.8 + 0.02 * (v % 4),
            "wait_s": 0.1 * (v % 2),
            "elapsed_s": 0.9 * v,
        }
        for v in range(1, n + 1)
    ]


class FakeControl:
    def __init__(self, n: int = 30) -> None:
        self.records = records(n)
        self.calls: list[tuple] = []

    def _check(self, name: str) -> None:
        if name != "demo":
            raise ControlError(404, f"no job {name!r}")

    def list(self) -> list[dict]:
        return [{"name": "demo", "state": "running", "version": len(self.records), "total_steps": 50,
                 "reward_mean": self.records[-1]["reward_mean"], "pools": {"generators": 2, "trainers": 1}}]  # fmt: skip

    def get(self, name: str) -> dict:
        self._check(name)
        return {
            "name": name, "state": "running", "version": len(self.records), "total_steps": 50,
            "pools": {"generators": 2, "rollout_workers": 4, "trainers": 1},
            "buffer": {"depth": 7, "dropped_stale": 3, "staleness": {"0": 40, "1": 25, "2": 9}},
        }  # fmt: skip

    def progress(self, name: str, since: int = 0) -> dict:
        self.calls.append((name, since))
        self._check(name)
        evals = [{"kind": "eval", "version": v, "eval": {"accuracy": v / 40, "pass@4": v / 30, "duration_s": 1.0}}
                 for v in (0, 10, 20, 30)]  # fmt: skip
        return {"name": name, "since": since, "next": len(self.records), "records": self.records[since:],
                "evals": evals}  # fmt: skip


def test_pages_need_no_token_and_hold_no_data() -> None:
    client = TestClient(create_app(TOKEN, FakeControl()))
    for path in ("/ui", "/ui/jobs/demo"):
        r = client.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert '<script src="/ui/app.js"></script>' in r.text
        assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
        assert "script-src 'self'" in r.headers["content-security-policy"]
        assert TOKEN not in r.text and "0.2" not in r.text
    js = client.get("/ui/app.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert "sessionStorage" in js.text and "/progress?since=" in js.text
    assert TOKEN not in js.text


def test_progress_route_requires_the_token() -> None:
    fake = FakeControl(12)
    client = TestClient(create_app(TOKEN, fake))
    assert client.get("/jobs/demo/progress").status_code == 401
    bad = client.get("/jobs/demo/progress", headers={"Authorization": "Bearer wrong"})
    assert bad.status_code == 401
    assert client.get(f"/jobs/demo/progress?token={TOKEN}").status_code == 401  # never from the URL
    assert fake.calls == []
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = client.get("/jobs/demo/progress", headers=auth)
    assert r.status_code == 200
    body = r.json()
    assert body["next"] == 12 and [x["version"] for x in body["records"]] == list(range(1, 13))
    r = client.get("/jobs/demo/progress?since=10", headers=auth).json()
    assert [x["version"] for x in r["records"]] == [11, 12]
    assert client.get("/jobs/nope/progress", headers=auth).status_code == 404
    assert client.get("/jobs/demo/progress?since=x", headers=auth).status_code == 422


def test_job_control_progress_reads_the_stream(redis_client, job_id) -> None:
    from replay_buffer.keys import JobKeys
    from slipstream.job.store import JobStore

    ctl = JobControl.__new__(JobControl)  # Redis only: no cluster, no Ray
    ctl.r, ctl.store = redis_client, JobStore(redis_client)
    with pytest.raises(ControlError) as e:
        ctl.progress(job_id)
    assert e.value.status == 404
    ctl.store.create(job_id, "{}", 1, 1)
    assert ctl.progress(job_id) == {
        "name": job_id,
        "run": None,
        "since": 0,
        "next": 0,
        "records": [],
        "evals": [],
    }
    key = JobKeys(job_id).progress
    for v in range(1, 151):  # more than one XREAD page (100)
        rec = {"version": v, "elapsed_s": float(v), "response_tokens": 10, "reward_mean": 0.5}
        redis_client.xadd(key, {"j": json.dumps(rec)})
    out = ctl.progress(job_id)
    assert out["next"] == 150 and [r["version"] for r in out["records"]] == list(range(1, 151))
    assert out["records"][-1]["tokens_per_s"] == pytest.approx(10.0)  # 1500 tokens in 150 s
    tail = ctl.progress(job_id, since=148)
    assert [r["version"] for r in tail["records"]] == [149, 150] and tail["next"] == 150
    with pytest.raises(ControlError):
        ctl.progress(job_id, since=-1)


@pytest.mark.skipif(shutil.which("node") is None, reason="no node binary to syntax-check the page's script")
def test_script_parses(tmp_path: Path) -> None:
    path = tmp_path / "app.js"
    path.write_text(APP_JS)
    subprocess.run(["node", "--check", str(path)], check=True, timeout=60)


@contextlib.contextmanager
def serving(control):
    """The API on a real uvicorn server (a thread); yields its base URL."""
    import uvicorn

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(TOKEN, control), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
            assert thread.is_alive(), "uvicorn did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


# A minimal DOM for node: enough for app.js to run against a real server (fetch is node's own).
NODE_HARNESS = r"""
const fs = require("fs");
const [base, path, script] = process.argv.slice(2);
class Node {
  constructor(tag) { this.tag = tag; this.attrs = {}; this.children = []; this.style = {}; this.textContent = "";
                     this.dataset = {}; this.value = ""; this.tBodies = [this]; }
  setAttribute(k, v) { this.attrs[k] = String(v); }
  appendChild(c) { this.children.push(c); return c; }
  append(...cs) { cs.forEach((c) => this.children.push(typeof c === "string" ? Object.assign(new Node("#text"), { textContent: c }) : c)); }
  replaceChildren(...cs) { this.children = []; this.append(...cs); }
  addEventListener() {}
  all() { return [this, ...this.children.flatMap((c) => c.all())]; }
}
const ids = {};
const byId = (id) => (ids[id] ??= new Node("div"));
const store = new Map();
const loc = new URL(path, base);
global.location = { hash: loc.hash, pathname: loc.pathname, search: loc.search };
global.history = { replaceState: (a, b, url) => { global.location.hash = ""; global.replaced = url; } };
global.sessionStorage = { getItem: (k) => store.get(k) ?? null, setItem: (k, v) => store.set(k, v), removeItem: (k) => store.delete(k) };
global.document = { getElementById: byId, createElement: (t) => new Node(t), createElementNS: (ns, t) => new Node(t),
                    body: { dataset: { page: loc.pathname === "/ui" ? "jobs" : "job" } }, title: "" };
const realFetch = fetch;
global.fetch = (p, opts) => realFetch(base + p, opts);
global.setInterval = () => 0;
eval(fs.readFileSync(script, "utf8"));
setTimeout(() => {
  const count = (id, tag) => byId(id).all().filter((n) => n.tag === tag).length;
  const out = { msg: byId("msg").textContent, auth: byId("auth").style.display || "", replaced: global.replaced,
                fragment: global.location.hash, name: byId("name").textContent, token: store.size,
                status: byId("status").all().map((n) => n.textContent).join(" | "),
                jobs: byId("jobs").all().filter((n) => n.tag === "a").map((n) => n.textContent), charts: {} };
  for (const id of ["c-reward", "c-stale", "c-tps", "c-step", "c-hist", "c-eval"]) {
    const lines = byId(id).all().filter((n) => n.tag === "polyline");
    out.charts[id] = { polylines: lines.map((l) => l.attrs.points.split(" ").length), rects: count(id, "rect") };
  }
  console.log(JSON.stringify(out));
}, 1500);
"""


def run_page(base: str, path: str, tmp_path: Path) -> dict:
    (tmp_path / "harness.js").write_text(NODE_HARNESS)
    (tmp_path / "app.js").write_text(APP_JS)
    out = subprocess.run(
        ["node", str(tmp_path / "harness.js"), base, path, str(tmp_path / "app.js")],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(shutil.which("node") is None, reason="no node binary to run the page's script")
def test_page_script_draws_the_charts_from_a_real_server(tmp_path: Path) -> None:
    """app.js run by node (a minimal DOM) against the API on uvicorn: the token from the URL fragment
    reaches the JSON routes, every chart gets a line per series with a point per record."""
    fake = FakeControl(30)
    with serving(fake) as base:
        page = run_page(base, f"/ui/jobs/demo#token={TOKEN}", tmp_path)
        assert page["msg"] == "" and page["auth"] == "", page
        assert page["fragment"] == "" and TOKEN not in page["replaced"]  # gone from the address bar
        assert page["name"] == "demo" and "state: running" in page["status"], page
        assert page["charts"]["c-reward"]["polylines"] == [30]
        assert page["charts"]["c-stale"]["polylines"] == [30, 30]
        assert page["charts"]["c-tps"]["polylines"] == [30, 30]
        assert page["charts"]["c-step"]["polylines"] == [30, 30]
        assert page["charts"]["c-hist"]["rects"] == 3  # staleness 0, 1, 2
        assert page["charts"]["c-eval"]["polylines"] == [4, 4]  # accuracy, pass@4 at 4 versions
        assert fake.calls == [("demo", 0)]
        jobs = run_page(base, f"/ui#token={TOKEN}", tmp_path)
        assert jobs["jobs"] == ["demo"] and jobs["msg"] == ""
        # no token, or a wrong one: the page asks for it and shows no data
        for path in ("/ui/jobs/demo", "/ui/jobs/demo#token=wrong"):
            page = run_page(base, path, tmp_path)
            assert page["auth"] == "block" and page["token"] == 0, page
            assert page["charts"]["c-reward"]["polylines"] == []
    assert fake.calls == [("demo", 0)]


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    return None


@pytest.mark.skipif(
    _chromium() is None, reason="no chromium, chromium-browser or google-chrome binary on PATH"
)
def test_page_renders_in_headless_chromium(tmp_path: Path) -> None:
    with serving(FakeControl()) as base:
        shot = tmp_path / "ui_status.png"
        # the token travels in the URL fragment, which the browser never sends to the server
        url = f"{base}/ui/jobs/demo#token={TOKEN}"
        cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                "--virtual-time-budget=4000"]  # fmt: skip
        dom = subprocess.run([*cmd, "--dump-dom", url], capture_output=True, text=True, timeout=120)
        assert "<polyline" in dom.stdout, dom.stderr[-2000:]  # the charts were drawn from the records
        assert "refused" not in dom.stdout
        args = [*cmd, f"--screenshot={shot}", "--window-size=1200,1000", url]
        subprocess.run(args, check=True, capture_output=True, timeout=120)
        data = shot.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
        if os.environ.get("SLIPSTREAM_UPDATE_SCREENSHOT"):  # docs/ui_status.png is refreshed on request only
            shutil.copyfile(shot, ROOT / "docs" / "ui_status.png")
