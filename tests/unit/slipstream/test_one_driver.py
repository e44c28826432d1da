"""One driver per job, ever: the run lease against a real Redis (a second holder refused, the lease lapsing
once its holder stops renewing, a submission the control plane ended never starting late)."""

from __future__ import annotations

import json
import os
import time

import pytest

from replay_buffer.keys import JobKeys
from slipstream.job.lease import LeaseRefused, RunLease
from slipstream.job.store import JobStore, NameTaken


def test_a_second_holder_is_refused_and_the_lease_lapses_with_its_holder(redis_client, job_id):
    store = JobStore(redis_client)
    sid = store.create(job_id, json.dumps({"name": job_id}), 1, 1)
    assert sid == store.status(job_id).ray_job_id and sid.startswith(f"slipstream-{job_id}-")
    first = RunLease(redis_client, job_id, sid, ttl_s=0.5)
    me = first.take()
    assert me["submission"] == sid and me["pid"] == os.getpid() and me["host"]

    second = RunLease(redis_client, job_id, sid, ttl_s=0.5)
    with pytest.raises(LeaseRefused, match=rf"already has a driver: submission {sid} \(pid {os.getpid()}"):
        second.take()
    with pytest.raises(LeaseRefused, match="is not the job's current submission"):
        RunLease(redis_client, job_id, f"slipstream-{job_id}-0").take()
    # the name is not free while a driver holds the lease, whatever the status says
    store.update_status(job_id, state="failed")
    with pytest.raises(NameTaken) as taken:
        store.create(job_id, json.dumps({"name": job_id}), 1, 1)
    assert taken.value.held

    # the holder dies (stops renewing): its lease lapses after the TTL and the next driver takes it
    deadline = time.monotonic() + 10
    while True:
        try:
            second.take()
            break
        except LeaseRefused:
            assert time.monotonic() < deadline, "the dead holder's lease never lapsed"
            time.sleep(0.05)
    assert not first.renew()  # the first cannot take it back from the live holder
    second.release()
    assert redis_client.get(JobKeys(job_id).lease) is None


def test_a_submission_ended_by_the_control_plane_never_starts_late(redis_client, job_id):
    store = JobStore(redis_client)
    sid = store.create(job_id, json.dumps({"name": job_id}), 1, 1)
    # a driver taking the lease while the control plane asks Ray: the marking is not written
    late = RunLease(redis_client, job_id, sid)
    st = store.settle(job_id, lambda st, held: late.take() and {"state": "interrupted"})
    assert st.state == "submitted" and redis_client.get(JobKeys(job_id).lease) is not None
    late.release()
    # Ray never got it: marked, and its driver, were Ray to start it after all, refuses to run
    st = store.settle(job_id, lambda st, held: {"state": "interrupted", "error": "never started"})
    assert st.state == "interrupted"
    with pytest.raises(LeaseRefused, match="no current submission"):
        RunLease(redis_client, job_id, sid).take()
    assert redis_client.get(JobKeys(job_id).lease) is None
