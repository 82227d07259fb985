"""Ports for the servers tests and benchmarks start: outside the kernel's ephemeral range, where no client
connection's source port can take one between the pick and the server's bind (a `mmrag serve` once failed with
"address already in use" 15 s after its port was picked, while another worker's clients made connections)."""

from __future__ import annotations

import socket

from mmrag.adapters import ports
from mmrag.devkit.ports import free_port
from serving.kv_events import free_port_pair


def test_the_ephemeral_range_is_read_from_the_kernel_and_defaults_to_linuxs(tmp_path):
    (tmp_path / "range").write_text("40000\t50000\n")
    assert ports.ephemeral_range(tmp_path / "range") == (40000, 50000)
    assert ports.ephemeral_range(tmp_path / "missing") == ports.LINUX_EPHEMERAL
    assert ports.candidate_ports((32768, 60999)) == range(20000, 32768)
    assert ports.candidate_ports((20500, 60999)) == range(61000, 65536)  # no room below: above it
    assert ports.candidate_ports((20500, 65000)) == range(0)


def test_picked_ports_are_outside_the_ephemeral_range_free_and_never_handed_out_twice():
    first, last = ports.ephemeral_range()
    picked = [free_port() for _ in range(50)]
    pair = free_port_pair()
    assert len(set(picked)) == len(picked) and {pair, pair + 1}.isdisjoint(picked)
    for port in [*picked, pair, pair + 1]:
        assert not first <= port <= last, port
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: a server can bind it


def test_a_port_something_listens_on_is_drawn_past(monkeypatch):
    with socket.socket() as listener:
        taken = ports.candidate_ports(ports.ephemeral_range()).start + 7
        listener.bind(("127.0.0.1", taken))
        listener.listen()
        draws = iter([taken, taken - 1, taken + 5])  # the pair at taken-1 would need taken too

        class Scripted:
            def randrange(self, start, stop):
                return next(draws)

        monkeypatch.setattr(ports, "_draw", Scripted())
        monkeypatch.setattr(ports, "_handed_out", set())
        assert ports.unused_ports(2) == taken + 5
