"""`slipstream status` rendering: replaced processes are shown only when there were any, and the last
failure with its cause, how often it repeated and what supervision did."""

from rich.console import Console

from slipstream.cli.jobs import render_status


def _text(st: dict) -> str:
    console = Console(width=120, record=True)
    console.print(render_status(st))
    return console.export_text()


def test_status_shows_replacements_when_there_were_some():
    st = {
        "name": "j",
        "state": "running",
        "restarts": {"rollout_workers": 1, "engines": 0, "trainer_pool": 2},
    }
    text = _text(st)
    assert "replaced" in text and "rollout workers 1" in text and "trainer pool 2" in text
    assert "engines 0" not in text
    calm = _text({"name": "j", "state": "running", "restarts": {"rollout_workers": 0, "engines": 0}})
    assert "replaced" not in calm


def test_status_shows_the_last_failure_its_repeats_and_the_restarts_left():
    import time

    failure = {
        "kind": "trainer_pool",
        "who": "trainer rank 0",
        "error_class": "out_of_memory",
        "cause": "CUDA out of memory. Tried to allocate 2.00 GiB.",
        "times": 2,
        "version": 17,
        "at": time.time() - 5,
        "restarts": 2,
        "action": "restarted",
        "fix": "lower trainer.micro_batch_tokens (now 8192)",
        "budget": 2,
        "resumed_at": 15,
    }
    st = {"name": "j", "state": "running", "restarts": {"trainer_pool": 2}, "failure": failure}
    text = " ".join(_text(st).split())
    assert "trainer rank 0: out of memory (2 in a row) at version 17" in text
    assert "CUDA out of memory. Tried to allocate 2.00 GiB." in text
    assert "1 more allowed for a repeat" in text and "resumed at version 15" in text
    assert "Fix: lower trainer.micro_batch_tokens (now 8192)" in text
    ended = {**failure, "times": 3, "action": "failed the job"}
    text = " ".join(_text({**st, "state": "failed", "failure": ended}).split())
    assert "(3 in a row)" in text and "failed the job" in text


def test_status_says_that_an_engine_replacement_waits_for_a_node_with_room():
    import time

    failure = {
        "kind": "engines",
        "who": "engine http://10.0.0.2:4000",
        "error_class": "other",
        "cause": "the actor's node was terminated expectedly: received SIGTERM",
        "times": 1,
        "version": 9,
        "at": time.time() - 20,
        "restarts": 1,
        "action": "restarted; the replacement has not started after 15 s, waiting for a node with room",
    }
    text = " ".join(
        _text({"name": "j", "state": "running", "restarts": {"engines": 1}, "failure": failure}).split()
    )
    assert "restarted (engines restart 1); the replacement has not started after 15 s" in text, text


def test_status_shows_waiting_replacements_and_engines_a_scale_up_added():
    waiting = {
        "http://10.0.0.2:4000": "restarted; the replacement has not started after 15 s, waiting ...",
        "engine-3": "added by a scale up; it has not started after 15 s, waiting for a node with room ...",
    }
    text = _text({"name": "j", "state": "running", "waiting": waiting})
    assert "engine http://10.0.0.2:4000: restarted; the replacement" in text, text
    assert "engine-3: added by a scale up; it has not started" in text and "engine engine-3" not in text, text


def test_status_shows_the_policy_recipe_metrics_and_the_run():
    st = {
        "name": "j",
        "state": "running",
        "lr": 2.5e-4,
        "clip_fraction": 0.125,
        "is_masked_fraction": 0.03,
        "behav_kl": 0.0123,
        "run_id": "abc123",
        "attempt": 2,
    }
    text = _text(st)
    assert "lr 0.00025" in text and "clipped 0.125" in text and "IS-masked 0.030" in text
    assert "behav_kl 0.0123" in text and "abc123 (attempt 2)" in text


def test_status_shows_the_optimizer_steps_and_ratio_of_minibatch_ppo():
    st = {
        "name": "j",
        "state": "running",
        "loss": -0.01,
        "optimizer_steps": 4,
        "prox_source": "recompute",
        "ratio_min": 0.875,
        "ratio_max": 1.25,
    }
    text = _text(st)
    assert "4 optimizer steps (pi_prox recompute)" in text and "ratio [0.875, 1.250]" in text


def test_progress_line_shows_the_clip_only_with_several_optimizer_steps():
    from slipstream.job.progress import format_progress

    record = {
        "step": 3, "version": 3, "reward_mean": 0.5, "staleness_mean": 0.0, "staleness_max": 0, "loss": 0.1,
        "tokens_per_s": 10.0, "step_s": 0.2, "wait_s": 0.1, "pause_s": 0.0, "clip_fraction": 0.125,
    }  # fmt: skip
    assert "clip" not in format_progress(record | {"optimizer_steps": 1}, 10)
    assert "clip" not in format_progress(record, 10)  # a record of a trainer without the count
    assert "clip 0.125 (4 optimizer steps)" in format_progress(record | {"optimizer_steps": 4}, 10)


def test_status_shows_where_tracking_writes_and_its_errors():
    st = {"name": "j", "state": "running"}
    assert "tracking" not in _text(st)
    st["tracking"] = {
        "tensorboard": "/o/tensorboard",
        "wandb": None,
        "version": 7,
        "writes": {},
        "errors": {},
    }
    text = _text(st)
    assert "tensorboard /o/tensorboard; version 7" in text and "errors" not in text
    st["tracking"]["errors"] = {"tensorboard": 2, "wandb": 1}
    assert "version 7, 3 errors" in _text(st)


def test_progress_line_names_stale_drops_and_their_length_only_when_there_were_some():
    from slipstream.job.progress import format_progress

    rec = {"step": 3, "version": 3, "reward_mean": 0.5, "staleness_mean": 0.5, "staleness_max": 1, "loss": 0.1,
           "tokens_per_s": 10.0, "step_s": 0.1, "wait_s": 0.1, "pause_s": 0.0, "stale_samples": 0,
           "len_stale_mean": None, "len_trained_mean": 12.0}  # fmt: skip
    assert "stale-dropped" not in format_progress(rec, 5)
    rec.update(stale_samples=8, len_stale_mean=30.2)
    assert format_progress(rec, 5).endswith("stale-dropped 8 samples (len 30 vs trained 12)")
