"""Grafana dashboards as code (deploy/grafana/dashboards/*.json): each parses, with the `job` and `replica`
variables, unique panel ids, the Prometheus datasource on every panel and query, and every query scoped to
the selected job."""

from __future__ import annotations

import re

from grafana_dashboards import DASHBOARDS, board_panels, load_board


def test_dashboards_parse_with_variables_and_datasource():
    assert {p.name for p in DASHBOARDS} == {"staleness.json", "throughput.json"}
    uids = set()
    for path in DASHBOARDS:
        board = load_board(path)
        uids.add(board["uid"])
        assert board["schemaVersion"] >= 36, path
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert {"job", "replica"} <= variables.keys(), path
        for v in variables.values():
            assert v["type"] == "query" and v["datasource"]["uid"] == "prometheus", (path, v["name"])
            assert v["query"]["query"].startswith("label_values("), (path, v["name"])
        assert variables["replica"]["includeAll"] and variables["replica"]["allValue"] == ".*"
        assert "$job" in variables["replica"]["query"]["query"]
        panels = board_panels(board)
        assert len(panels) >= 6, path
        ids = [p["id"] for p in board["panels"]] + [
            q["id"] for p in board["panels"] for q in p.get("panels", [])
        ]
        assert len(set(ids)) == len(ids), f"{path}: panel ids repeat"
        for p in panels:
            assert p["datasource"] == {"type": "prometheus", "uid": "prometheus"}, (path, p["title"])
            assert p["targets"], (path, p["title"])
            for t in p["targets"]:
                assert t["datasource"]["uid"] == "prometheus", (path, p["title"])
                # every query is scoped to the selected job
                selectors = re.findall(r"\{([^}]*)\}", t["expr"].replace("{{", "").replace("}}", ""))
                assert selectors and all('job=~"$job"' in s for s in selectors), (path, p["title"], t["expr"])
    assert len(uids) == len(DASHBOARDS)
