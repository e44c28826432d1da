"""The end-of-job report: synthetic progress records -> four valid PNGs; nothing for no records."""

from __future__ import annotations

import struct
from pathlib import Path

from slipstream.job.report import write_report, write_report_logged

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def records(n: int = 12) -> list[dict]:
    return [
        {
            "version": v,
            "reward_mean": 0.1 + 0.05 * v,
            "staleness_mean": (v % 3) / 2,
            "staleness_max": v % 3,
            "tokens_per_s": 1000.0 + 10 * v,
            "train_tokens_per_s": 5000.0 - 20 * v,
            "step_s": 0.5 + 0.01 * v,
            "wait_s": 0.1,
            "elapsed_s": 0.6 * v,
            "len_trained_mean": 20.0 + v,
            "len_trained_p90": 40.0 + v,
            "len_stale_mean": 60.0 if v % 4 == 0 else None,
            "len_stale_p90": 90.0 if v % 4 == 0 else None,
            "stale_samples": 8 if v % 4 == 0 else 0,
        }
        for v in range(1, n + 1)
    ]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR" and data[-8:-4] == b"IEND"
    return struct.unpack(">II", data[16:24])


def test_report_writes_four_pngs(tmp_path: Path) -> None:
    paths = write_report(records(), tmp_path / "out")
    names = sorted(p.name for p in paths)
    assert names == [
        "report_lengths.png",
        "report_reward.png",
        "report_staleness.png",
        "report_throughput.png",
    ]
    for p in paths:
        assert p.parent == tmp_path / "out"
        w, h = png_size(p)
        assert w >= 600 and h >= 300


def test_report_missing_keys_and_empty(tmp_path: Path) -> None:
    assert write_report([], tmp_path) == []
    assert list(tmp_path.iterdir()) == []
    # only reward is known: the staleness and throughput figures have nothing to show
    paths = write_report([{"version": 1, "reward_mean": 0.5}, {"version": 2}], tmp_path)
    assert [p.name for p in paths] == ["report_reward.png"]
    png_size(paths[0])
    # records of nothing usable
    assert write_report([{"step": 1}], tmp_path / "x") == []


def test_report_failure_never_raises(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert write_report_logged(records(3), blocker / "out") == []
