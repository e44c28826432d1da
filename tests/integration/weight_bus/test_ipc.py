"""The IPC weight handoff (bus.backend ipc) on CPU, with real processes: built-in engines in their own
processes load the trainer's buckets straight from its shared memory through /update_weights_from_tensor,
bit for bit; the bus reuses its ring of bucket buffers across buckets and updates; an engine killed
mid-handoff is dropped while the other gets the update; a refused name is BusError; payloads are
SGLang's (field names, pickled globals), in both directions."""

from __future__ import annotations

import base64
import io
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import http_calls
import ipc_engine
import msgspec
import pytest
import torch
from bus_engines import AUTH, KEY, ROOT, noisy_model, version
from metrics_text import sample

from weight_bus import BusError, EngineClient, WeightBus, ipc, metrics
from weight_bus.errors import Refused
from weight_bus.ipc_transfer import BucketRing, wait_event
from weight_bus.schema import UpdateWeightsFromTensor

ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


class IpcEngine(ipc_engine.IpcEngine):
    """A built-in engine in its own process (tests/harness/ipc_engine.py) with the tests' key."""

    def __init__(self, model_dir: Path, tmp: Path, device: str = "cpu") -> None:
        super().__init__(model_dir, tmp, KEY, device)


@pytest.fixture(scope="module")
def engines(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ipc")
    procs = [IpcEngine(model_dir, tmp) for _ in range(2)]
    yield procs
    for p in procs:
        p.kill()


def _assert_holds(weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for name, want in expected.items():
        got = weights[name]
        assert got.dtype == torch.float32, name  # the CPU engine's dtype: loads cast into it
        assert torch.equal(got, want.to(got.dtype)), name


def _torch_shm_files() -> set[str]:
    """This process's torch shared-memory files (file_system strategy: /dev/shm/torch_<pid>_...)."""
    return {f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{os.getpid()}_")}


def test_publish_over_ipc_bit_for_bit_and_ring_reused(engines, tmp_path):
    """Many buckets (one tensor each) to two engine processes, three updates: every engine holds the
    model bit for bit after each; the ring's buffers are the same storage in every update after the
    first, and the trainer creates no new shared memory."""
    model = noisy_model(tmp_path / "b", 2)
    named = dict(model.state_dict())
    bus = WeightBus([e.url for e in engines], api_key=KEY, backend="ipc", bucket_bytes=1)
    bus.connect()
    try:
        stats = bus.publish(named.items(), version=11)
        assert stats.buckets == len(named) >= 20
        assert stats.bytes == sum(t.numel() * 4 for t in named.values())
        assert sorted(stats.engines) == sorted(e.url for e in engines) and not stats.dropped
        assert len(stats.timeline) == stats.buckets and stats.rebuilds == 0
        ring = bus.transfer.ring
        assert isinstance(ring, BucketRing) and len(ring.slots) == 3  # max_inflight 2, plus one
        ptrs = [s.data_ptr() for s in ring.slots]
        handles = [s.untyped_storage()._share_filename_cpu_()[1] for s in ring.slots]
        held, shm = ring.nbytes, _torch_shm_files()
        assert held <= 3 * max(t.numel() * 4 for t in named.values())
        for e in engines:
            _assert_holds(e.weights(), named)
        for v in (12, 13, 14):
            with torch.no_grad():
                for t in named.values():
                    t.add_(0.25)
            bus.publish(named.items(), version=v)
            assert [s.data_ptr() for s in ring.slots] == ptrs
            assert [s.untyped_storage()._share_filename_cpu_()[1] for s in ring.slots] == handles
            # No new shared memory: the ring's files, and (until this update ended) the engines' mappings
            # of slots the first update outgrew, which they close now.
            assert ring.nbytes == held and _torch_shm_files() <= shm
            assert {h.decode().lstrip("/") for h in handles} <= _torch_shm_files()
        for e in engines:
            _assert_holds(e.weights(), named)
            assert version(e.url) == "14"
            text = http_calls.get(e.url + "/metrics").text  # the engine observes each bucket's phases
            assert sample(text, "slipstream_engine_weight_updates_total") >= 4 * len(named)
            for phase in ("wait", "receive", "load"):
                n = sample(text, "slipstream_engine_weight_bucket_seconds_count", phase=phase)
                assert n >= 4 * len(named), phase
        assert metrics.UPDATES.labels("ipc")._value.get() >= 4
    finally:
        bus.close()


def test_publish_over_ipc_casts_to_the_wire_dtype(engines, tmp_path):
    """bus.dtype bfloat16: the buckets carry bf16 (half the bytes); the fp32 engines load the cast."""
    model = noisy_model(tmp_path / "c", 4)
    named = dict(model.state_dict())
    bus = WeightBus([engines[0].url], api_key=KEY, backend="ipc", bucket_bytes=48 * 1024, dtype="bfloat16")
    bus.connect()
    try:
        stats = bus.publish(named.items(), version=21)
        assert stats.bytes >= sum(t.numel() * 2 for t in named.values()) and stats.buckets > 1
        _assert_holds(engines[0].weights(), {n: t.to(torch.bfloat16) for n, t in named.items()})
    finally:
        bus.close()


def _payload(load_format, named: list[tuple[str, torch.Tensor]]) -> tuple[str, torch.Tensor | None]:
    """One rank's entry as SGLang's Engine.update_weights_from_tensor builds it; for flattened_bucket, a
    flat uint8 buffer in shared memory with every tensor at a multiple of its element size."""
    if load_format != ipc.FLATTENED_BUCKET:
        return ipc.serialize(named), None
    offsets, off = [], 0
    for _, t in named:
        off = -(-off // t.element_size()) * t.element_size()
        offsets.append(off)
        off += t.numel() * t.element_size()
    flat = torch.zeros(off, dtype=torch.uint8)
    for (_, t), o in zip(named, offsets, strict=True):
        flat[o : o + t.numel() * t.element_size()].copy_(t.reshape(-1).view(torch.uint8))
    meta = [(n, list(t.shape), t.dtype, o) for (n, t), o in zip(named, offsets, strict=True)]
    return ipc.serialize(ipc.flattened_bucket(flat, meta)), flat


@pytest.mark.parametrize("load_format", [None, "direct", "flattened_bucket"])
def test_route_loads_mixed_dtypes_in_both_formats(engines, tmp_path, load_format):
    """POST /update_weights_from_tensor with tensors of several dtypes and shapes: the engine copies each
    into the parameter of that name in its own dtype, and takes the version after the load."""
    model = noisy_model(tmp_path / f"d{load_format}", 5)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    seen: set[int] = set()  # tied weights (lm_head = embed_tokens) once: the engine's are one tensor too
    distinct = [
        (n, p) for n, p in model.state_dict().items() if not (p.data_ptr() in seen or seen.add(p.data_ptr()))
    ]
    named = [(n, p.detach().to(dtypes[i % 4])) for i, (n, p) in enumerate(distinct)]
    entry, _keep = _payload(load_format, named)
    body = UpdateWeightsFromTensor(
        serialized_named_tensors=[entry], load_format=load_format, weight_version="v-route"
    )
    with EngineClient(KEY, 60) as client:
        answer = client.update_weights_from_tensor(engines[1].url, body)
    ref = answer.pop("payload_ref")
    assert answer == {"success": True, "message": "Success"} and ref.startswith(ipc.PAYLOAD_REF)
    _assert_holds(engines[1].weights(), dict(named))
    assert version(engines[1].url) == "v-route"


def test_route_refuses_with_the_reason(engines, tmp_path):
    """400 {"success": false, "message"}: more than one TP rank's entry, an unknown name, a shape
    mismatch (each named), an unknown load_format, a payload naming a class outside the allowlist; the
    weights and the version are unchanged."""
    url = engines[1].url
    before = engines[1].weights()
    v = version(url)
    good, _ = _payload(None, [("model.norm.weight", torch.ones(before["model.norm.weight"].shape))])
    evil = base64.b64encode(b"cos\nsystem\n(S'true'\ntR.").decode()
    cases = [
        ({"serialized_named_tensors": [good, good]}, "tp_size 1"),
        ({"serialized_named_tensors": [_payload(None, [("nope.weight", torch.ones(2))])[0]]}, "nope.weight"),
        ({"serialized_named_tensors": [_payload(None, [("model.norm.weight", torch.ones(3, 3))])[0]]},
         "model.norm.weight"),
        ({"serialized_named_tensors": [good], "load_format": "bogus"}, "load_format"),
        ({"serialized_named_tensors": [evil]}, "os.system is not allowed"),
    ]  # fmt: skip
    for body, reason in cases:
        r = http_calls.post(
            url + "/update_weights_from_tensor", json={**body, "weight_version": "x"}, headers=AUTH
        )
        assert r.status_code == 400, body
        assert r.json()["success"] is False and reason in r.json()["message"], r.json()
    after = engines[1].weights()
    assert all(torch.equal(before[n], after[n]) for n in before) and version(url) == v


def test_route_loads_a_payload_it_keeps_by_reference(engines, tmp_path):
    """The built-in engine's answer names the payload it keeps; that reference, sent in the payload's
    place, loads what the sender's memory holds now. A reference the engine does not keep (never given,
    or dropped with everything it kept after a failed load) is a 400 that says to send the payload, and
    changes nothing."""
    url = engines[1].url
    named = [(n, p.detach().clone()) for n, p in noisy_model(tmp_path / "r", 8).state_dict().items()]
    named = list({t.data_ptr(): (n, t) for n, t in named}.values())  # tied weights once
    entry, _ = _payload(None, named)
    with EngineClient(KEY, 60) as client:
        ref = client.update_weights_from_tensor(
            url, UpdateWeightsFromTensor(serialized_named_tensors=[entry], weight_version="r1")
        )["payload_ref"]
        torch._foreach_mul_([t for _, t in named], 3.0)  # in place: the memory the engine keeps mapped
        again = client.update_weights_from_tensor(
            url, UpdateWeightsFromTensor(serialized_named_tensors=[ref], weight_version="r2")
        )
        assert again["success"] and again["payload_ref"] == ref
        _assert_holds(engines[1].weights(), dict(named))
        assert version(url) == "r2"

        before = engines[1].weights()
        unknown = ipc.PAYLOAD_REF + "0" * 32
        bad = [unknown, _payload(None, [("nope.weight", torch.ones(2))])[0], ref]  # the failure drops ref
        for body in bad:
            r = http_calls.post(
                url + "/update_weights_from_tensor",
                json={"serialized_named_tensors": [body], "weight_version": "x"},
                headers=AUTH,
            )
            assert r.status_code == 400 and r.json()["success"] is False
        assert "send the payload" in r.json()["message"] and ref in r.json()["message"]
        after = engines[1].weights()
        assert all(torch.equal(before[n], after[n]) for n in before) and version(url) == "r2"


def test_refused_name_is_bus_error_and_engines_continue(engines, tmp_path):
    model = noisy_model(tmp_path / "e", 6)
    named = [*model.state_dict().items(), ("no.such.weight", torch.ones(4))]
    bus = WeightBus([engines[0].url], api_key=KEY, backend="ipc", bucket_bytes=64 * 1024)
    bus.connect()
    try:
        with pytest.raises(BusError, match="no.such.weight"):
            bus.publish(iter(named), version=31)
        info = http_calls.get(engines[0].url + "/get_server_info", headers=AUTH).json()
        assert info["internal_states"][0]["paused"] is False
        assert version(engines[0].url) != "31"
        stats = bus.publish(model.state_dict().items(), version=32)  # the ring is usable again
        assert stats.engines == [engines[0].url]
    finally:
        bus.close()


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP])
def test_engine_lost_mid_handoff_is_dropped(model_dir, tmp_path, fault):
    """The trainer's (lazy) iterator kills (or freezes: no answer within timeout_s) one engine halfway
    through the buckets: the update goes on, the survivor holds every tensor and the version, and
    publish returns normally naming the lost one."""
    a, b = IpcEngine(model_dir, tmp_path), IpcEngine(model_dir, tmp_path)
    model = noisy_model(tmp_path / "f", 7)
    named = dict(model.state_dict())
    bus = WeightBus([a.url, b.url], api_key=KEY, backend="ipc", bucket_bytes=1, timeout_s=3)
    bus.connect()
    hit = threading.Event()

    def tensors():
        for i, item in enumerate(named.items()):
            if i == len(named) // 2:
                b.send_signal(fault)
                hit.set()
            yield item

    try:
        stats = bus.publish(tensors(), version=41)
        assert hit.is_set()
        assert stats.dropped == [b.url] and stats.engines == [a.url]
        assert stats.buckets == len(named)
        _assert_holds(a.weights(), named)
        assert version(a.url) == "41"
    finally:
        bus.close()
        if fault == signal.SIGSTOP:
            b.send_signal(signal.SIGCONT)
        a.kill()
        b.kill()


# ---- SGLang's contract -----------------------------------------------------------------------------

SGLANG_TENSOR_FIELDS = {
    "serialized_named_tensors": None,
    "load_format": None,
    "flush_cache": True,
    "abort_all_requests": False,
    "weight_version": None,
}
"""UpdateWeightsFromTensorReqInput (python/sglang/srt/managers/io_struct.py): names and defaults."""


def test_request_json_is_sglangs():
    body = UpdateWeightsFromTensor(serialized_named_tensors=["x"])
    assert msgspec.json.decode(msgspec.json.encode(body)) == {
        **SGLANG_TENSOR_FIELDS,
        "serialized_named_tensors": ["x"],
    }
    # a body SGLang's clients send with its defaults left out decodes to the same
    assert msgspec.json.decode(b'{"serialized_named_tensors": ["x"]}', type=UpdateWeightsFromTensor) == body


def _globals(payload: str) -> set[str]:
    """The globals a pickle names (module.name), read without loading any of them."""
    found: set[str] = set()

    class Anything:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def __setstate__(self, state) -> None:
            pass

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str):
            found.add(f"{module}.{name}")
            return Anything

    Recorder(io.BytesIO(base64.b64decode(payload))).load()
    return found


def test_payload_pickles_sglangs_names():
    """A flattened bucket names SGLang's metadata class and torch's file_system rebuild, nothing else,
    whatever the process's sharing strategy; no stand-in module is left behind."""
    flat = torch.zeros(16, dtype=torch.uint8)
    payload = ipc.serialize(ipc.flattened_bucket(flat, [("w", [2, 2], torch.float32, 0)]))
    assert _globals(payload) == {
        "sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata",
        "torch.multiprocessing.reductions.rebuild_tensor",
        "torch.multiprocessing.reductions.rebuild_typed_storage",
        "torch.multiprocessing.reductions.rebuild_storage_filename",
        "torch.storage.UntypedStorage",
        "torch.Tensor",
        "torch.Size",
        "torch.uint8",
        "torch.float32",
    }
    # (SGLang's frontend may be imported by other tests in this process: only stand-ins are checked)
    assert not [
        m
        for m in list(sys.modules)
        if (m == "sglang" or m.startswith("sglang.")) and getattr(sys.modules[m], "_slipstream_alias", False)
    ]


FAKE_TENSOR_BUCKET = """
from dataclasses import dataclass
import torch

@dataclass
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@dataclass
class LocalSerializedTensor:  # SGLang keeps it elsewhere under sglang.srt; loaders match it by name
    values: list
"""

SGLANG_SIDE = """
import base64, io, pickle, sys
from multiprocessing.reduction import ForkingPickler
import torch, torch.multiprocessing
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata, LocalSerializedTensor


def dumps(obj):
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return buf.getvalue()

if sys.argv[1] == "load":  # what SGLang's deserializer does with our payload (its allowlist admits these)
    obj = pickle.loads(base64.b64decode(sys.stdin.read()))
    m = obj["metadata"][0]
    assert type(m) is FlattenedTensorMetadata, type(m)
    flat = obj["flattened_tensor"]
    print(flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape).tolist())
else:  # what an SGLang sender (slime) writes, CPU tensors shared by the file_system strategy
    torch.multiprocessing.set_sharing_strategy("file_system")
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    flat = t.reshape(-1).view(torch.uint8).clone()
    meta = [FlattenedTensorMetadata("model.norm.weight", t.shape, t.dtype, 0, 24, 24)]
    print(base64.b64encode(dumps({"flattened_tensor": flat, "metadata": meta})).decode(), flush=True)
    wrapped = [("model.norm.weight", LocalSerializedTensor(values=[dumps(t * 2)]))]  # verl's direct form
    print(base64.b64encode(dumps(wrapped)).decode(), flush=True)
    sys.stdin.read()  # keep the shared memory alive until the reader is done
"""


def test_payloads_cross_between_sglang_and_ours(tmp_path):
    """Ours loads as SGLang's objects in a process with SGLang's module, and one pickled there by
    ForkingPickler (as MultiprocessingSerializer does) loads through ours: separate processes."""
    pkg = tmp_path / "sglang" / "srt" / "weight_sync"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "sglang", tmp_path / "sglang" / "srt", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "tensor_bucket.py").write_text(FAKE_TENSOR_BUCKET)
    env = {**ENV, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    script = tmp_path / "side.py"
    script.write_text(SGLANG_SIDE)

    t = torch.arange(4, dtype=torch.bfloat16).reshape(2, 2)
    flat = t.reshape(-1).view(torch.uint8).clone()
    ours = ipc.serialize(ipc.flattened_bucket(flat, [("w", [2, 2], torch.bfloat16, 0)]))
    out = subprocess.run(
        [sys.executable, str(script), "load"],
        input=ours,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(t.tolist())

    sender = subprocess.Popen(
        [sys.executable, str(script), "dump"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        theirs = sender.stdout.readline().strip()
        [(name, got)] = ipc.load_payload(theirs, ipc.FLATTENED_BUCKET)
        assert name == "model.norm.weight"
        assert torch.equal(got, torch.arange(6, dtype=torch.float32).reshape(2, 3))
        [(name, got)] = ipc.load_payload(sender.stdout.readline().strip(), None)
        assert name == "model.norm.weight"
        assert torch.equal(got, 2 * torch.arange(6, dtype=torch.float32).reshape(2, 3))
    finally:
        sender.communicate("", timeout=60)


def test_deserialize_refuses_descriptors_and_foreign_classes():
    with pytest.raises(Exception, match="file_system"):
        ipc.deserialize(
            base64.b64encode(b"ctorch.multiprocessing.reductions\nrebuild_storage_fd\n.").decode()
        )
    with pytest.raises(Exception, match="builtins.eval is not allowed"):
        ipc.deserialize(base64.b64encode(b"cbuiltins\neval\n.").decode())


def test_ipc_refuses_an_engine_on_another_host():
    bus = WeightBus(["http://192.0.2.1:30000"], api_key=KEY, backend="ipc")  # TEST-NET-1: never this host
    try:
        with pytest.raises(BusError, match="on this host only"):
            bus.connect()
    finally:
        bus.close()


def test_engine_client_refused_is_refused(engines):
    with EngineClient(KEY, 30) as client, pytest.raises(Refused, match="tp_size 1"):
        client.update_weights_from_tensor(
            engines[0].url, UpdateWeightsFromTensor(serialized_named_tensors=["a", "b"])
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_handles_cross_processes(tmp_path):
    """A CUDA tensor serialized here is opened by CUDA IPC in another process (by device UUID)."""
    t = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    flat = t.view(torch.uint8)
    payload = ipc.serialize(ipc.flattened_bucket(flat, [("w", [1 << 20], torch.float32, 0)]))
    code = (
        "import sys, torch; from weight_bus import ipc; "
        "[(n, x)] = ipc.load_payload(sys.stdin.read(), 'flattened_bucket'); "
        "print(n, x.device.type, float(x.sum()), float(x[12345]))"
    )
    out = subprocess.run([sys.executable, "-c", code], input=payload, env=ENV, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["w", "cuda", str(float(t.sum())), "12345.0"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_publish_over_cuda_ipc_to_an_engine_on_the_same_gpu(model_dir, tmp_path):
    """Colocated: trainer weights on the GPU, the engine on the same GPU; the buckets live in the bus's
    CUDA ring and reach the engine (bf16) as CUDA-IPC handles, bit for bit, in every update."""
    engine = IpcEngine(model_dir, tmp_path, device="cuda")
    named = {n: t.to("cuda") for n, t in noisy_model(tmp_path / "g", 8).state_dict().items()}
    bus = WeightBus([engine.url], api_key=KEY, backend="ipc", bucket_bytes=64 * 1024)
    bus.connect()
    try:
        for v in (51, 52):
            with torch.no_grad():
                for t in named.values():
                    t.add_(0.25)
            stats = bus.publish(named.items(), version=v)
            assert stats.engines == [engine.url] and stats.buckets > 1
            assert all(s is None or s.is_cuda for s in bus.transfer.ring.slots)
            got = engine.weights()
            for n, t in named.items():
                assert got[n].dtype == torch.bfloat16, n  # the engine's dtype on CUDA: the wire's too
                assert torch.equal(got[n], t.to(torch.bfloat16).cpu()), n
        assert version(engine.url) == "52"
    finally:
        bus.close()
        engine.kill()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_direct_publish_on_cuda_answers_with_an_event_and_sends_references(model_dir, tmp_path):
    """The trainer's own bf16 CUDA tensors go direct: the engine answers once its copy is queued, with its
    interprocess event, which the bus waits on; repeats go as the reference the engine answered. The
    engine holds every version bit for bit, and generates from it (its steps run after the copy)."""
    engine = IpcEngine(model_dir, tmp_path, device="cuda")  # the event and the copy kernel: defaults
    named = {n: t.to("cuda", torch.bfloat16) for n, t in noisy_model(tmp_path / "g", 9).state_dict().items()}
    named = dict({t.data_ptr(): (n, t) for n, t in named.items()}.values())  # tied weights once
    bus = WeightBus([engine.url], api_key=KEY, backend="ipc", bucket_bytes=1 << 30)
    bus.connect()
    try:
        for v in (61, 62, 63):
            with torch.no_grad():
                torch._foreach_add_(list(named.values()), 0.125)
            stats = bus.publish(named.items(), version=v, persistent=True)
            assert (stats.handoff, stats.paused) == ("direct", False)
            member = bus.members.engines[0]
            assert member.copy_event is not None and member.payload_refs_before  # event waited, ref kept
            got = engine.weights()
            for n, t in named.items():
                assert torch.equal(got[n], t.cpu()), (v, n)
        text = http_calls.get(engine.url + "/metrics").text
        assert sample(text, "slipstream_engine_ipc_payloads_total", how="ref") == 2
        r = http_calls.post(
            engine.url + "/generate",
            json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
            headers=AUTH,
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["meta_info"]["weight_version"] == "63"
    finally:
        bus.close()
        engine.kill()


def test_engines_keep_ring_mapped_and_close_a_replaced_ring(engines, tmp_path):
    """Engines keep the trainer's ring slots mapped between updates (no reopen per call) and close the
    mappings of a ring the trainer replaced once an update through the new ring completes: the old
    ring's shared-memory files outlive the trainer's own reference only until then."""
    model = noisy_model(tmp_path / "r", 2)
    named = dict(model.state_dict())
    before = _torch_shm_files()
    bus = WeightBus([e.url for e in engines], api_key=KEY, backend="ipc", bucket_bytes=1)
    bus.connect()
    try:
        bus.publish(named.items(), version=21)
        old = _torch_shm_files() - before
        assert old  # the ring's slots
    finally:
        bus.close()
    del bus
    import gc

    gc.collect()
    # The trainer dropped its ring; the engines still map it, so its files are still there.
    assert old <= _torch_shm_files()
    bus = WeightBus([e.url for e in engines], api_key=KEY, backend="ipc", bucket_bytes=1)
    bus.connect()
    try:
        with torch.no_grad():
            for t in named.values():
                t.add_(0.5)
        bus.publish(named.items(), version=22)
        now = _torch_shm_files()
        assert not (old & now)  # the replaced ring is closed everywhere
        assert now - before  # the new ring stays mapped
        for e in engines:
            _assert_holds(e.weights(), named)
            assert version(e.url) == "22"
    finally:
        bus.close()


class _Event:
    """Stands in for an engine's CUDA event (query() as torch.cuda.Event has it): done after `after` s."""

    def __init__(self, after: float | None) -> None:
        self.done_at = None if after is None else time.monotonic() + after

    def query(self) -> bool:
        return self.done_at is not None and time.monotonic() >= self.done_at


def test_the_wait_for_an_engines_copy_event_is_bounded():
    """The bus waits for an engine's copy event (an answer that came once the copy was queued) until the
    update's deadline, not forever: an engine that died or hung after answering fails the update's call
    as one that did not answer, and is dropped."""
    assert wait_event(_Event(0.0), time.monotonic() + 1.0)
    assert wait_event(_Event(0.02), time.monotonic() + 1.0)  # past the spin: polled
    t0 = time.monotonic()
    assert not wait_event(_Event(None), t0 + 0.05)
    assert 0.05 <= time.monotonic() - t0 < 1.0
