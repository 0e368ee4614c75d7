"""This machine's CPU time shares around a request (/proc/stat), and when they describe the server's."""

import pytest

from freetoken import host_load


def test_shares_split_the_ticks_between_two_reads():
    #          user nice system idle iowait irq softirq steal
    before = (1000, 0, 200, 5000, 10, 0, 5, 0)
    after = (1600, 0, 300, 5200, 10, 0, 45, 100)  # 1,040 ticks: 740 busy, 200 idle, 100 stolen
    got = host_load.shares(before, after)
    assert got == {"busy": round(740 / 1040, 4), "idle": round(200 / 1040, 4), "iowait": 0.0,
                   "steal": round(100 / 1040, 4)}
    assert host_load.shares(before, before) is None  # no tick passed
    assert host_load.shares(None, after) is None


def test_reads_this_machines_counters_or_none(tmp_path, monkeypatch):
    now = host_load.read()
    assert now is None or (len(now) == len(host_load.FIELDS) and all(v >= 0 for v in now))
    fake = tmp_path / "stat"
    fake.write_text("cpu  1 2 3 4 5 6 7 8 9 10\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    monkeypatch.setattr(host_load, "STAT", fake)
    assert host_load.read() == (1, 2, 3, 4, 5, 6, 7, 8)
    fake.write_text("intr 12 34\n")  # not the shape expected
    assert host_load.read() is None
    monkeypatch.setattr(host_load, "STAT", tmp_path / "missing")
    assert host_load.read() is None


@pytest.mark.parametrize("endpoint, local", [("http://127.0.0.1:1919", True), ("http://localhost:8080/", True),
                                             ("http://[::1]:1919", True), ("http://127.0.0.2:1919", True),
                                             ("http://10.0.0.5:1919", False), ("https://api.example.com", False)])
def test_only_a_loopback_endpoint_shares_this_machine(endpoint, local):
    assert host_load.is_local(endpoint) is local
