"""`free_port`: a port outside the kernel's ephemeral range, so no bind to port 0 can take it between the
probe and the service's bind."""

import socket

from common import net


def test_free_port_is_bindable_and_below_the_ephemeral_range():
    low, _ = net.ephemeral_range()
    ports = {net.free_port() for _ in range(20)}
    for port in ports:
        assert net.PICK_LOW <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free, as promised
    assert len(ports) > 1  # picked at random, not one fixed port


def test_a_port_in_use_is_never_picked(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(net, "PICK_LOW", taken)
        monkeypatch.setattr(net, "PICK_TRIES", 2)
        monkeypatch.setattr(net, "ephemeral_range", lambda: (taken + 3, 60999))
        # both candidates, `taken` and `taken + 1`, are tried: only the second can come back, or the kernel's
        for _ in range(10):
            assert net.free_port() != taken


def test_no_room_below_the_ephemeral_range_falls_back_to_the_kernels_pick(monkeypatch):
    monkeypatch.setattr(net, "ephemeral_range", lambda: (net.PICK_LOW, 60999))
    port = net.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
