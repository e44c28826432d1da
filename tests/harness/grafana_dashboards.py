"""Grafana's dashboards as code (deploy/grafana/dashboards/*.json) for the deploy tests: where they are, each
board read from its file, and a board's panels."""

from __future__ import annotations

import json
from pathlib import Path

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))


def load_board(path: Path) -> dict:
    return json.loads(path.read_text())


def board_panels(board: dict) -> list[dict]:
    """Every panel, rows' nested panels included, rows themselves excluded."""
    out = []
    for p in board["panels"]:
        if p["type"] == "row":
            out += p.get("panels", [])
        else:
            out.append(p)
    return out
