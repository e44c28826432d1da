"""A trainer with nothing to train while engines wait to join publishes its current weights to them
(bus.idle_sync_s) instead of waiting for a step that cannot come: with every engine dropped or still
joining, no rollout ever fills its batch. Real redis-server, a real built-in engine over HTTP, a gloo
update group, the trainer's own loop (Trainer.run) in a thread."""

from __future__ import annotations

import threading
import time

import torch
from prometheus_client import REGISTRY

import jobspec
from generator_fleet.engine import EngineServer
from trainer.trainer import Trainer
from weight_bus.registry import EngineRegistration, EngineRegistry

KEY = "idle-key"
LIMIT_S = 120.0
"""Only so that a regression fails instead of hanging the suite (the publish comes after ~0.5 s)."""


def _spec(job_id, model_dir, out) -> jobspec.JobSpec:
    return jobspec.loads(
        f"""
name: {job_id}
output_dir: {out}
model: {{path: {model_dir}}}
algorithm: {{groups_per_step: 2, total_steps: 10}}
buffer: {{read_block_ms: 100}}
trainer: {{export_hf: false}}
bus: {{backend: gloo, timeout_s: 10.0, idle_sync_s: 0.5}}
"""
    )


def _idle_publishes() -> float:
    return REGISTRY.get_sample_value("slipstream_trainer_idle_publishes_total") or 0.0


def test_trainer_without_a_batch_admits_a_joining_engine(
    redis_server, redis_client, job_id, tiny_model_dir, tmp_path
):
    engine = EngineServer(str(tiny_model_dir), api_key=KEY, torch_threads=1).start()
    joining = EngineRegistration(redis_client, job_id, engine.url, joining=True)
    registry = EngineRegistry(redis_client, job_id)
    trainer = Trainer(
        _spec(job_id, tiny_model_dir, tmp_path / "out").trainer_config(), redis_server.url, [], KEY
    )
    out: dict = {}
    try:
        trainer.setup()  # no engine in the update group: the only one is joining
        assert trainer.bus.urls == [] and registry.live() == [] and registry.joining() == [engine.url]
        with torch.no_grad():  # the trainer's weights differ from the model the engine loaded
            for p in trainer.learner.model.parameters():
                p.add_(0.25)
        before = _idle_publishes()

        def run() -> None:
            try:
                out["result"] = trainer.run()
            except BaseException as e:
                out["error"] = e

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        deadline = time.monotonic() + LIMIT_S

        def admitted() -> bool:
            """The registry admits the engine inside the publish; the publish is counted once it returned."""
            return registry.live() == [engine.url] and _idle_publishes() >= before + 1

        while not admitted() and time.monotonic() < deadline and thread.is_alive():
            time.sleep(0.1)
        assert registry.live() == [engine.url] and registry.joining() == [], out
        assert trainer.bus.urls == [engine.url]
        assert trainer.buffer.version() == 0  # no step: the buffer is empty, the wait goes on
        assert _idle_publishes() == before + 1  # one publish admitted it; none since (nobody waits)
        trainer.stop()
        thread.join(LIMIT_S)
        assert not thread.is_alive(), "the trainer did not stop"
        assert "error" not in out, out
        assert out["result"].version == 0
        trained = dict(trainer.learner.full_parameters())
        served = engine.runner.model.state_dict()
        for name, tensor in trained.items():
            assert torch.equal(served[name], tensor), name  # the engine holds the trainer's weights
    finally:
        trainer.stop()
        trainer.close()
        joining.close()
        engine.stop()
