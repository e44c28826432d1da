"""A model directory for nodes without `model.path` (slipstream/job/model_files.py), against a real
redis-server: the driver ships every file but the weights; a process on a node without the directory gets
a node-local copy it can load the tokenizer and config from, and one that needs the weights (a trainer rank,
a LoRA job's engine) fails naming the path, the node and why; a directory the driver never shipped fails
too, and a shipped name cannot write outside the copy."""

from __future__ import annotations

import json
import tempfile

import pytest
from transformers import AutoConfig, AutoTokenizer

from replay_buffer.keys import JobKeys
from slipstream.job import model_files


def test_a_node_without_the_model_loads_its_config_and_tokenizer_from_what_the_driver_shipped(
    redis_server, redis_client, job_id, tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "node-tmp"))  # the node's temp directory
    (tmp_path / "node-tmp").mkdir()
    weights = [p.name for p in tiny_model_dir.iterdir() if p.name.endswith(model_files.WEIGHT_SUFFIXES)]
    assert weights, "the tiny model should have weight files"
    size = model_files.publish(redis_client, job_id, tiny_model_dir)
    shipped = {k.decode() for k in redis_client.hkeys(JobKeys(job_id).model_files)}
    assert "config.json" in shipped and not shipped & set(weights)
    assert size == sum((tiny_model_dir / n).stat().st_size for n in shipped)

    gone = str(tmp_path / "not-on-this-node")
    path, have_weights = model_files.local_model(gone, "rollout-0", redis_server.url, job_id)
    assert not have_weights and path.startswith(str(tmp_path / "node-tmp" / model_files.CACHE / job_id))

    def config(p):
        return {k: v for k, v in AutoConfig.from_pretrained(p).to_dict().items() if k != "_name_or_path"}

    assert config(path) == config(tiny_model_dir)
    text = "12+7=19"
    assert (
        AutoTokenizer.from_pretrained(path)(text)["input_ids"]
        == AutoTokenizer.from_pretrained(tiny_model_dir)(text)["input_ids"]
    )
    # a second process of the node reuses the copy
    assert model_files.local_model(gone, "engine-0", redis_server.url, job_id) == (path, False)
    # where the model is, it is used as it is
    assert model_files.local_model(str(tiny_model_dir), "engine-0", redis_server.url, job_id) == (
        str(tiny_model_dir),
        True,
    )


def test_what_needs_the_weights_or_was_never_shipped_fails_naming_path_node_and_why(
    redis_server, redis_client, job_id, tiny_model_dir, tmp_path
):
    gone = str(tmp_path / "absent")
    with pytest.raises(
        FileNotFoundError,
        match=r"engine-0: model.path .*absent does not exist on node .* and the driver shipped none",
    ):
        model_files.local_model(gone, "engine-0", redis_server.url, job_id)
    model_files.publish(redis_client, job_id, tiny_model_dir)
    with pytest.raises(
        FileNotFoundError,
        match=r"trainer-0: model.path .*absent does not exist on node .* and a trainer rank loads it",
    ):
        model_files.local_model(
            gone, "trainer-0", redis_server.url, job_id, need_weights="a trainer rank loads it"
        )


def test_a_shipped_name_cannot_write_outside_the_copy(
    redis_server, redis_client, job_id, tmp_path, monkeypatch
):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    redis_client.hset(JobKeys(job_id).model_files, mapping={"../escape.json": json.dumps({}).encode()})
    with pytest.raises(ValueError, match="outside the model directory"):
        model_files.local_model(str(tmp_path / "absent"), "rollout-0", redis_server.url, job_id)
