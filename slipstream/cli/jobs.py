"""`slipstream submit | list | status | logs | scale | stop | checkpoint | rm`: the control API's client.

Where the API is: --api-url / $SLIPSTREAM_API_URL with $SLIPSTREAM_API_TOKEN, else the cluster at
--home / $SLIPSTREAM_HOME / ~/.slipstream (what `make cluster-up` started). An https:// API behind a
reverse proxy with a private CA: --ca-cert FILE / $SLIPSTREAM_CA_CERT (common/tls.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx
import msgspec
from msgspec import UNSET

from common import tls
from slipstream.job.records import Status, known, status_from_dict

TERMINAL = ("succeeded", "failed", "stopped", "interrupted")
SUBMIT_TIMEOUT_S = 90.0
"""How long `submit` waits for the control API's answer (longer than the other calls' timeout): the API tries
Ray's job server up to 3 times, and on a cluster just started each try can wait 10 s for Ray's job agent
(slipstream/cluster/control.py: SUBMIT_TRIES, NO_AGENT)."""


class ApiError(Exception):
    pass


def _readable(detail) -> str:
    """An error answer's detail as one line: a message as it is; FastAPI's list of field errors (a request
    that does not fit the schema) as `field: message (got value)` per field."""
    if not isinstance(detail, list):
        return str(detail)
    parts = []
    for err in detail:
        if not isinstance(err, dict):
            parts.append(str(err))
            continue
        loc = [str(x) for x in err.get("loc", ())]
        if loc and loc[0] in ("body", "query", "path", "header"):
            loc = loc[1:]
        where = ".".join(loc) or "request"
        got = f" (got {err['input']!r})" if "input" in err and not isinstance(err["input"], dict) else ""
        parts.append(f"{where}: {err.get('msg', err.get('type', 'invalid'))}{got}")
    return "invalid request: " + "; ".join(parts)


class ControlClient:
    def __init__(self, url: str, token: str, timeout_s: float = 30.0, ca_cert: str | None = None) -> None:
        """`ca_cert`: a PEM file of CAs to trust for an https:// `url` besides the public ones (None:
        $SLIPSTREAM_CA_CERT, else httpx's default, which honours $SSL_CERT_FILE)."""
        try:
            verify = tls.verify(ca_cert)
        except (OSError, ValueError) as e:
            raise ApiError(str(e)) from None
        self.http = httpx.Client(
            base_url=url.rstrip("/"),
            headers={"Authorization": f"Bearer {token}"},
            timeout=timeout_s,
            verify=verify,
        )

    @classmethod
    def from_env(
        cls, api_url: str | None = None, home: str | None = None, ca_cert: str | None = None
    ) -> ControlClient:
        url = api_url or os.environ.get("SLIPSTREAM_API_URL")
        if url:
            token = os.environ.get("SLIPSTREAM_API_TOKEN")
            if not token:
                raise ApiError(
                    "SLIPSTREAM_API_TOKEN is not set (the token of the control API at " + url + ")"
                )
            return cls(url, token, ca_cert=ca_cert)
        from slipstream.cluster.state import load_info

        try:
            info = load_info(home)
        except FileNotFoundError as e:
            raise ApiError(str(e)) from None
        return cls(info.api_url, info.api_token, ca_cert=ca_cert)

    def _call(self, method: str, path: str, **kw):
        try:
            resp = self.http.request(method, path, **kw)
        except httpx.HTTPError as e:
            if why := tls.describe(e):
                raise ApiError(f"control API at {self.http.base_url}: {why}") from None
            raise ApiError(
                f"control API at {self.http.base_url} unreachable: {e} (is the cluster up?)"
            ) from None
        if resp.status_code >= 400:
            try:
                detail = resp.json().get("detail")
            except ValueError:
                detail = resp.text
            raise ApiError(f"{_readable(detail)} (HTTP {resp.status_code})")
        return resp.json()

    def submit(self, spec_text: str, overrides: list[str], cwd: str) -> dict:
        read = self.http.timeout.read
        return self._call(
            "POST",
            "/jobs",
            json={"spec": spec_text, "overrides": overrides, "cwd": cwd},
            timeout=None if read is None else max(read, SUBMIT_TIMEOUT_S),
        )

    def list(self) -> list[dict]:
        return self._call("GET", "/jobs")

    def get(self, name: str) -> dict:
        return self._call("GET", f"/jobs/{name}")

    def logs(self, name: str, component: str | None, tail: int) -> dict:
        params = {"tail": tail, **({"component": component} if component else {})}
        return self._call("GET", f"/jobs/{name}/logs", params=params)

    def scale(self, name: str, generators: int | None, trainers: int | None) -> dict:
        return self._call(
            "POST", f"/jobs/{name}/scale", json={"generators": generators, "trainers": trainers}
        )

    def stop(self, name: str, force: bool = False, checkpoint: bool = True) -> dict:
        return self._call("POST", f"/jobs/{name}/stop", json={"force": force, "checkpoint": checkpoint})

    def checkpoint(self, name: str) -> dict:
        return self._call("POST", f"/jobs/{name}/checkpoint")

    def remove(self, name: str, purge: bool = False) -> dict:
        return self._call("DELETE", f"/jobs/{name}", params={"purge": purge})


def add_overrides(parser) -> None:
    """`--set KEY=VALUE` (repeatable): a spec key's value, given as YAML, over the file's."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a spec key, e.g. --set algorithm.lr=1e-4 (repeatable; VALUE is YAML)",
    )


def add_parsers(sub) -> None:
    def common(p):
        p.add_argument(
            "--api-url", help="control API (default: $SLIPSTREAM_API_URL, else the local cluster's)"
        )
        p.add_argument(
            "--home", help="cluster state directory (default: $SLIPSTREAM_HOME, else ~/.slipstream)"
        )
        p.add_argument(
            "--ca-cert",
            metavar="FILE",
            help="PEM file of the CA that signed an https:// control API's certificate, trusted besides "
            "the public CAs (default: $SLIPSTREAM_CA_CERT)",
        )
        return p

    s = common(sub.add_parser("submit", help="submit a job to the cluster"))
    s.add_argument("spec", help="job spec YAML")
    add_overrides(s)
    s.add_argument("--watch", action="store_true", help="then show its status live until it ends")
    common(sub.add_parser("list", help="the cluster's jobs"))
    st = common(sub.add_parser("status", help="a job's version, staleness, throughput, pools, reward"))
    st.add_argument("job")
    st.add_argument("--watch", action="store_true", help="refresh live until the job ends (Ctrl-C leaves)")
    st.add_argument("--json", action="store_true", help="print the full status record as JSON")
    lg = common(sub.add_parser("logs", help="a job's driver log, or one component's (--component)"))
    lg.add_argument("job")
    lg.add_argument("--component", help="e.g. trainer-0, engine-1, rollout-0 (default: the driver)")
    lg.add_argument(
        "--tail", type=int, default=200, metavar="N", help="the last N lines (default 200; 0: all)"
    )
    sc = common(sub.add_parser("scale", help="set a running job's generator and/or trainer pool sizes"))
    sc.add_argument("job")
    sc.add_argument(
        "--generators",
        type=int,
        metavar="N",
        help="engines, each with its rollout workers; new ones join at the next weight update",
    )
    sc.add_argument(
        "--trainers",
        type=int,
        metavar="M",
        help="trainer ranks; the pool checkpoints and restarts with M ranks (M > 1 needs trainer.fsdp)",
    )
    sp = common(sub.add_parser("stop", help="stop a job after the trainer's current step"))
    sp.add_argument("job")
    sp.add_argument("--force", action="store_true", help="stop the Ray job now (no checkpoint at the stop)")
    sp.add_argument(
        "--no-checkpoint",
        dest="checkpoint",
        action="store_false",
        help="write no checkpoint at the stop (by default one is written, whatever checkpoint_every says)",
    )
    ck = common(sub.add_parser("checkpoint", help="write a checkpoint after the current step"))
    ck.add_argument("job")
    rm = common(sub.add_parser("rm", help="remove an ended job's records (refuses a job that runs)"))
    rm.add_argument("job")
    rm.add_argument(
        "--purge",
        action="store_true",
        help="also delete its output directory, $SLIPSTREAM_HOME/jobs/JOB, and nothing outside it (a "
        "symlink there: the link only; default: kept)",
    )


COMMANDS = ("submit", "list", "status", "logs", "scale", "stop", "checkpoint", "rm")


def _fmt(v, spec: str = ".3f") -> str:
    return "-" if v is None or v is UNSET else format(v, spec) if isinstance(v, float) else str(v)


def failure_line(f: dict) -> str:
    """The status' `failure` (slipstream/job/supervise.py Failure) in one line: who, what, how often in a
    row, when, and what supervision did about it."""
    what = f.get("error_class", "other").replace("_", " ")
    times = f.get("times", 1)
    ago = time.time() - f.get("at", time.time())
    line = f"{f.get('who')}: {what}" + (f" ({times} in a row)" if times > 1 else "")
    line += f" at version {f.get('version')}, {ago:.0f} s ago: {f.get('cause') or '-'}"
    action = f.get("action") or ""
    if action.startswith("restarted"):
        line += f"; restarted ({f.get('kind', '').replace('_', ' ')} restart {f.get('restarts')}"
        if f.get("budget") is not None:
            line += f"; {max(0, f['budget'] - times + 1)} more allowed for a repeat"
        line += ")"
        if f.get("resumed_at") is not None:
            line += f", resumed at version {f['resumed_at']}"
        line += action.removeprefix("restarted")  # what became of an engine's replacement: "; ..."
    else:
        line += f"; {f.get('action')}"
    if f.get("fix"):
        line += f". Fix: {f['fix']}"
    return line


def render_status(st: Status | dict):
    """A rich table of one job's status (a Status, or the control API's JSON of one)."""
    from rich.table import Table

    if isinstance(st, dict):
        st = status_from_dict(st)
    t = Table(title=f"job {known(st.name, None)}: {known(st.state, None)}", show_header=False, box=None)
    pools, buf = known(st.pools, {}), known(st.buffer, {})
    want = {} if st.desired is UNSET else msgspec.to_builtins(st.desired)
    rows = [
        ("version", f"{known(st.version, 0)} / {known(st.total_steps, '?')}"),
        ("reward (mean)", _fmt(st.reward_mean)),
        ("staleness", f"mean {_fmt(st.staleness_mean, '.2f')}, max {_fmt(st.staleness_max)}"),
        ("throughput", f"{_fmt(st.tokens_per_s, '.0f')} generated tok/s, "
         f"{_fmt(st.samples_per_s, '.2f')} samples/s, trainer {_fmt(st.train_tokens_per_s, '.0f')} tok/s"),
        ("step", f"{_fmt(st.step_s, '.2f')} s, loss {_fmt(st.loss, '+.4f')}, "
         f"{_fmt(st.optimizer_steps)} optimizer steps (pi_prox {_fmt(st.prox_source)})"),
        ("policy", f"lr {_fmt(st.lr, '.3g')}, clipped {_fmt(st.clip_fraction)}, "
                   f"ratio [{_fmt(st.ratio_min)}, {_fmt(st.ratio_max)}], "
                   f"IS-masked {_fmt(st.is_masked_fraction)}, behav_kl {_fmt(st.behav_kl, '.4f')}"),
        ("generators", f"{pools.get('generators', '-')} (want {want.get('generators', '-')}), "
         f"rollout workers {pools.get('rollout_workers', '-')}"),
        ("trainers", f"{pools.get('trainers', '-')} (want {want.get('trainers', '-')}), memory peak "
         f"{_fmt(st.memory_peak_gib, '.1f')} GiB, micro-batches of {_fmt(st.micro_batch_tokens)} tokens"),
        ("buffer", f"depth {buf.get('depth', '-')}, pending {buf.get('pending', '-')}, "
         f"produced {buf.get('produced', '-')}, consumed {buf.get('consumed', '-')}, "
         f"dropped stale {buf.get('dropped_stale', '-')}"),
        ("output", str(known(st.output_dir, "-"))),
        ("run", f"{known(st.run_id, '-')} (attempt {known(st.attempt, '-')})"),
    ]  # fmt: skip
    if ev := st.eval:  # the last evaluation on the held-out set (a spec with `eval`)
        scores = "  ".join(
            f"{k} {_fmt(v)}"
            for k, v in ev.items()
            if k in ("accuracy", "greedy_reward") or k.startswith("pass@")
        )
        rows.insert(
            2, ("eval", f"version {ev.get('version', '-')}: {scores} ({_fmt(ev.get('duration_s'), '.1f')} s)")
        )
    for who, note in (st.waiting or {}).items():  # engines no node has room for yet (a URL: a replacement)
        rows.append(("waiting", f"{'engine ' if '://' in who else ''}{who}: {note}"))
    if st.phase:  # what a job that is not running yet (or is stopping) is doing
        rows.insert(0, ("phase", st.phase))
    if st.stale_s is not UNSET:  # the API could not reach Redis: its last answer, and how old
        rows.insert(0, ("STALE", f"last known state, {st.stale_s:.0f} s old: {known(st.stale_reason, None)}"))
    if any((restarts := st.restarts or {}).values()):
        rows.append(("replaced", ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in restarts.items() if v)))
    if failure := st.failure:
        rows.append(("last failure", failure_line(failure)))
    if st.schedule:  # placement colocated: how engines and trainer share the devices
        handoff = (
            f", engines release {_fmt(st.release_s)} s / resume {_fmt(st.resume_s)} s per step"
            if st.release_s not in (UNSET, None)
            else ""
        )
        rows.append(("placement", f"colocated, {st.schedule} schedule{handoff}"))
    if st.scaling:
        rows.append(("scaling", st.scaling))
    if tr := st.tracking:
        where = ", ".join(f"{k} {tr[k]}" for k in ("tensorboard", "wandb") if tr.get(k)) or "off"
        errors = sum((tr.get("errors") or {}).values())
        rows.append(
            (
                "tracking",
                f"{where}; version {tr.get('version', '-')}" + (f", {errors} errors" if errors else ""),
            )
        )
    if st.note:
        rows.append(("checkpoint", st.note))
    if st.error:
        rows.append(("error", st.error))
    drv = st.driver or {}  # the one driver holding the job's run lease
    at = f"; driver pid {drv.get('pid')} on {drv.get('host')}" if drv else ""
    rows.append(("ray job", f"{known(st.ray_job_id, '-')} ({known(st.ray_status, '-')}){at}"))
    for k, v in rows:
        t.add_row(k, v)
    return t


def _watch(client: ControlClient, name: str) -> int:
    from rich.live import Live

    st = status_from_dict(client.get(name))
    with Live(render_status(st), refresh_per_second=2) as live:
        while st.state not in TERMINAL:
            time.sleep(2)
            st = status_from_dict(client.get(name))
            live.update(render_status(st))
    return 0 if st.state in ("succeeded", "stopped") else 1


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    con = Console()
    try:
        client = ControlClient.from_env(args.api_url, args.home, args.ca_cert)
        if args.cmd == "submit":
            from jobspec import JobSpecError
            from jobspec.loader import decode

            try:
                # the API takes text: bytes that are not UTF-8 are refused here, naming the file and offset
                text = decode(Path(args.spec).read_bytes(), args.spec)
            except (OSError, JobSpecError) as e:
                print(f"slipstream: {e}", file=sys.stderr)
                return 2
            cwd = os.getcwd()  # relative paths in a spec: the working directory's, as in run and validate
            out = client.submit(text, args.overrides, cwd)
            print(f"submitted job {out['name']} (Ray job {out['ray_job_id']}); output in {out['output_dir']}")
            if out.get("note"):
                print(f"note: {out['note']}")
            print(f"follow it: slipstream status {out['name']} --watch")
            return _watch(client, out["name"]) if args.watch else 0
        if args.cmd == "list":
            jobs = client.list()
            if not jobs:
                print("no jobs")
            for j in jobs:
                p = j.get("pools", {})
                print(
                    f"{j['name']:<24} {j['state'] or '-':<10} version {j['version']}/{j['total_steps'] or '?'}  "
                    f"reward {_fmt(j['reward_mean'])}  generators {p.get('generators', '-')}  trainers {p.get('trainers', '-')}"
                )
            return 0
        if args.cmd == "status":
            if args.watch:
                return _watch(client, args.job)
            st = client.get(args.job)
            if args.json:
                print(json.dumps(st, indent=2))
            else:
                con.print(render_status(st))
            return 0
        if args.cmd == "logs":
            out = client.logs(args.job, args.component, args.tail)
            if out.get("note"):
                print(f"# {out['note']}", file=sys.stderr)
            print("\n".join(out["lines"]))
            if args.component is None and out["components"]:
                print(
                    f"# components: {', '.join(out['components'])} (slipstream logs {args.job} --component NAME)"
                )
            return 0
        if args.cmd == "scale":
            out = client.scale(args.job, args.generators, args.trainers)
            print(f"job {args.job}: desired {out['desired']}")
            return 0
        if args.cmd == "stop":
            out = client.stop(args.job, args.force, args.checkpoint)
            print(f"job {args.job}: {'stop requested: ' if out['stop'] else ''}{out['message']}")
            return 0
        if args.cmd == "rm":
            out = client.remove(args.job, args.purge)
            kept = "deleted" if out["output_removed"] else "kept"
            if out.get("link_removed"):
                kept += f" (the link {out['link_removed']} removed; --purge never follows it)"
            elif args.purge and not out["output_removed"]:
                kept += " (--purge deletes only the job's own directory under $SLIPSTREAM_HOME/jobs)"
            print(f"job {args.job} removed ({out['keys']} Redis keys); output {out['output_dir']} {kept}")
            return 0
        if args.cmd == "checkpoint":
            client.checkpoint(args.job)
            print(f"job {args.job}: checkpoint requested (after the current step)")
            return 0
    except ApiError as e:
        print(f"slipstream: {e}", file=sys.stderr)
        return 1
    raise AssertionError(args.cmd)
