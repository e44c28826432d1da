"""Checkpoints are complete or absent: a save writes under a temporary name and renames into place when
complete, so `latest`, pruning and a resume only ever see whole checkpoints. A save that hits a full disk
(a real ENOSPC, from a write to /dev/full between the shards and the state file) removes its partial
directory, leaves `latest` on the previous checkpoint and raises ENOSPC naming the path and the free space
there; one killed outright leaves a partial directory that the next save removes. One CPU rank, no process
group."""

from __future__ import annotations

import errno

import pytest
import torch

import jobspec
from trainer import checkpoint
from trainer.distributed import DistInfo, RankGroup
from trainer.faults import Faults
from trainer.learner import Learner


@pytest.fixture(scope="module")
def learner(tiny_model_dir):
    spec = jobspec.from_dict({"model": {"path": str(tiny_model_dir)}, "trainer": {"fsdp": False}})
    pool = RankGroup(DistInfo(0, 1, "127.0.0.1", 0), torch.device("cpu"))
    ln = Learner(spec.model, spec.algorithm, spec.trainer, pool, response_budget=16)
    ln.setup()
    return ln


def _save(learner, root, version: int, **kw):
    state = {"step": version, "version": version}
    return checkpoint.save(learner, checkpoint.step_dir(root, version), state, keep=2, **kw)


def test_a_checkpoint_is_renamed_into_place_complete_and_latest_follows(learner, tmp_path):
    path = _save(learner, tmp_path, 1)
    assert path == tmp_path / "step-00000001" and (path / checkpoint.STATE_FILE).exists()
    assert checkpoint.resolve(checkpoint.LATEST, tmp_path) == path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]  # nothing partial


def test_a_full_disk_leaves_no_partial_checkpoint_and_latest_on_the_previous_one(learner, tmp_path):
    first = _save(learner, tmp_path, 2)
    with pytest.raises(OSError) as err:
        _save(learner, tmp_path, 4, before_complete=lambda: Faults("enospc@4").checkpoint(4))
    msg = str(err.value)
    print(msg)
    assert err.value.errno == errno.ENOSPC
    assert f"writing checkpoint {tmp_path / 'step-00000004'}" in msg and "free of" in msg
    assert isinstance(err.value.__cause__, OSError) and err.value.__cause__.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000002"]
    assert checkpoint.resolve(checkpoint.LATEST, tmp_path) == first  # a restart resumes from here


def test_a_save_killed_outright_is_cleaned_up_by_the_next_and_pruning_counts_complete_ones(learner, tmp_path):
    for v in (1, 2):
        _save(learner, tmp_path, v)
    killed = checkpoint.partial_dir(checkpoint.step_dir(tmp_path, 9))  # what kill -9 mid-save leaves
    killed.mkdir()
    (killed / "__0_0.distcp").write_bytes(b"half")
    _save(learner, tmp_path, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000002", "step-00000003"]
    again = _save(learner, tmp_path, 3)  # the same step again replaces it whole
    assert checkpoint.resolve(checkpoint.LATEST, tmp_path) == again
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000002", "step-00000003"]
