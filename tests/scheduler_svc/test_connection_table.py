"""The eviction choice of a full listener: the most crowded peer's least recently active idle or
stalled connection; never one being answered; per IPv4 address and IPv6 /64."""
import pytest

from scheduler_svc.connection_table import ConnectionTable, ConnState, peer_key


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float = 1.0) -> None:
        self.now += seconds


@pytest.fixture
def clock():
    return Clock()


def table_of(clock, max_connections=8, stall_s=1.0) -> ConnectionTable:
    return ConnectionTable(max_connections, stall_s=stall_s, clock=clock)


def add(table, clock, peer, *names):
    for name in names:
        table.add(name, peer)
        clock.tick(0.1)


def test_the_most_crowded_peers_least_recently_active_idle_connection(clock):
    table = table_of(clock)
    add(table, clock, "10.0.0.1", "old-a")  # the oldest of all, but its peer holds one
    add(table, clock, "10.0.0.2", "b1", "b2", "b3")
    table.touch("b1")  # b1 spoke since: b2 is b's least recently active
    assert table.victim() == "b2"
    table.remove("b2")
    table.remove("b3")
    add(table, clock, "10.0.0.1", "a2")  # a now holds two, b one
    assert table.victim() == "old-a"


def test_busy_connections_are_never_chosen_but_count_for_their_peer(clock):
    table = table_of(clock)
    add(table, clock, "10.0.0.1", "a1", "a2", "a3")
    add(table, clock, "10.0.0.2", "b1", "b2")
    for name in ("a1", "a2"):
        table.set_state(name, ConnState.BUSY)
    assert table.victim() == "a3"  # a holds three, two of them busy
    table.set_state("a3", ConnState.BUSY)
    assert table.victim() == "b1"
    for name in ("b1", "b2"):
        table.set_state(name, ConnState.BUSY)
    assert table.victim() is None
    table.set_state("a1", ConnState.IDLE)  # its answer ended: idle from now on
    assert table.victim() == "a1"


def test_a_reader_is_chosen_only_once_stalled(clock):
    table = table_of(clock, stall_s=1.0)
    add(table, clock, "10.0.0.1", "reader")
    table.set_state("reader", ConnState.READING)
    assert table.victim() is None
    clock.tick(0.5)
    table.touch("reader")  # more of its request came
    clock.tick(0.9)
    assert table.victim() is None
    clock.tick(0.2)
    assert table.victim() == "reader"
    add(table, clock, "10.0.0.1", "idle")  # idle, but more recently active than the stalled one
    assert table.victim() == "reader"
    table.touch("reader")
    assert table.victim() == "idle"


def test_counts_follow_adds_and_removes(clock):
    table = table_of(clock, max_connections=2)
    add(table, clock, "10.0.0.1", "a", "b")
    assert table.full() and len(table) == 2 and "a" in table
    table.remove("a")
    table.remove("a")  # twice: no effect
    assert not table.full() and table.state("a") is None and table.state("b") is ConnState.IDLE
    table.remove("b")
    assert table.victim() is None and len(table) == 0


def test_many_peers_the_choice_stays_right_as_counts_change(clock):
    """Against a plain scan over every connection, through a long run of random changes."""
    import random

    rng = random.Random(0)
    table = table_of(clock, max_connections=10_000, stall_s=0.5)
    live: dict[str, tuple[str, ConnState, float]] = {}
    for step in range(3000):
        clock.tick(0.01)
        op = rng.random()
        if op < 0.4 or not live:
            name, peer = f"c{step}", f"10.0.0.{rng.randrange(12)}"
            table.add(name, peer)
            live[name] = (peer, ConnState.IDLE, clock.now)
        elif op < 0.6:
            name = rng.choice(sorted(live))
            table.remove(name)
            del live[name]
        elif op < 0.85:
            name = rng.choice(sorted(live))
            state = rng.choice(list(ConnState))
            if state is not live[name][1]:
                table.set_state(name, state)
                live[name] = (live[name][0], state, clock.now)
        else:
            name = rng.choice(sorted(live))
            table.touch(name)
            if live[name][1] is not ConnState.BUSY:
                live[name] = (live[name][0], live[name][1], clock.now)
        assert table.victim() in expected_victims(live, clock.now, 0.5)


def expected_victims(live, now, stall_s) -> set:
    counts: dict[str, int] = {}
    for peer, _, _ in live.values():
        counts[peer] = counts.get(peer, 0) + 1
    candidates = {name: (peer, at) for name, (peer, state, at) in live.items()
                  if state is ConnState.IDLE or state is ConnState.READING and at <= now - stall_s}
    if not candidates:
        return {None}
    top = max(counts[peer] for peer, _ in candidates.values())
    oldest = {peer: min(at for p, at in candidates.values() if p == peer)
              for peer, _ in candidates.values() if counts[peer] == top}
    return {name for name, (peer, at) in candidates.items() if oldest.get(peer) == at}


@pytest.mark.parametrize("host,key", [
    ("192.0.2.7", "192.0.2.7"), ("::ffff:192.0.2.7", "192.0.2.7"),
    ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"), ("2001:db8:1:2:bbbb::9", "2001:db8:1:2::/64"),
    ("fe80::1%eth0", "fe80::/64"), ("", ""), (None, ""), ("some-name", "some-name")])
def test_a_peer_is_an_ipv4_address_or_an_ipv6_64(host, key):
    assert peer_key(host) == key
