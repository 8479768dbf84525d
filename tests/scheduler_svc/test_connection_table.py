"""The eviction choice of a full listener: the most crowded peer's least recently active idle or
stalled connection; else, for a newcomer, the least recently active connection (busy too) of a
peer over its share, never one of the newcomer's own peer; per IPv4 address and IPv6 /64."""
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


def test_busy_connections_are_not_chosen_for_idle_room_but_count_for_their_peer(clock):
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


@pytest.mark.parametrize("removes,busy_share", [(0.6, 0.0), (0.75, 0.9)])
def test_many_peers_the_choice_stays_right_as_counts_change(clock, removes, busy_share):
    """Against a plain scan over every connection, through a long run of random changes; the
    second run keeps few connections, most of them busy, so that often none is idle."""
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
            if rng.random() < busy_share:
                table.set_state(name, ConnState.BUSY)
                live[name] = (peer, ConnState.BUSY, clock.now)
        elif op < removes:
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
            live[name] = (live[name][0], live[name][1], clock.now)
        assert table.victim() in expected_victims(live, clock.now, 0.5)
        newcomer = f"10.0.0.{rng.randrange(14)}"  # two peers that hold none
        assert table.victim(newcomer) in expected_victims(live, clock.now, 0.5, newcomer)


def expected_victims(live, now, stall_s, newcomer=None) -> set:
    counts: dict[str, int] = {}
    for peer, _, _ in live.values():
        counts[peer] = counts.get(peer, 0) + 1
    held = counts.get(newcomer, 0)
    stalled = now - stall_s
    candidates = {name: (peer, at) for name, (peer, state, at) in live.items()
                  if counts[peer] >= held and (
                      state is ConnState.IDLE or state is ConnState.READING and at <= stalled)}
    if not candidates and newcomer is not None and counts:
        top = max(counts.values())
        if top >= held + 2:  # the newcomer's peer would still hold fewer
            candidates = {name: (peer, at) for name, (peer, _, at) in live.items()
                          if counts[peer] == top}
    if not candidates:
        return {None}
    top = max(counts[peer] for peer, _ in candidates.values())
    oldest = {peer: min(at for p, at in candidates.values() if p == peer)
              for peer, _ in candidates.values() if counts[peer] == top}
    return {name for name, (peer, at) in candidates.items() if oldest.get(peer) == at}


def busy(table, clock, peer, *names):
    add(table, clock, peer, *names)
    for name in names:
        table.set_state(name, ConnState.BUSY)


def test_a_peer_over_its_share_loses_its_least_recently_active_busy_connection(clock):
    table = table_of(clock)
    busy(table, clock, "10.0.0.1", "a1", "a2", "a3", "a4", "a5", "a6")
    busy(table, clock, "10.0.0.2", "b1")
    table.set_state("a1", ConnState.IDLE)
    table.set_state("a1", ConnState.BUSY)  # a new request: a2 is a's least recently active
    assert table.victim() is None  # no idle connection
    assert table.victim("10.0.0.3") == "a2"  # a holds 6, the newcomer's peer none
    assert table.victim("10.0.0.2") == "a2"  # b would hold 2, still fewer than 6
    assert table.victim("10.0.0.1") is None  # never for a newcomer of its own
    table.touch("a2")  # its client sent something (a new call on its connection)
    assert table.victim("10.0.0.3") == "a3"
    table.set_state("a4", ConnState.READING)  # a request arriving, not stalled
    clock.tick(5)
    assert table.victim("10.0.0.3") == "a4"  # stalled now: chosen for idle room
    table.touch("a4")
    assert table.victim("10.0.0.3") == "a3"


def test_an_idle_connection_makes_room_before_any_busy_one(clock):
    table = table_of(clock)
    busy(table, clock, "10.0.0.1", "a1", "a2", "a3", "a4", "a5")
    add(table, clock, "10.0.0.2", "b1")  # b's only connection, idle
    assert table.victim("10.0.0.3") == "b1"


def test_a_crowded_peers_newcomer_takes_no_idle_place_of_a_peer_holding_fewer(clock):
    table = table_of(clock)
    busy(table, clock, "10.0.0.1", "a1", "a2", "a3", "a4")
    add(table, clock, "10.0.0.2", "b1", "b2")  # idle, between two requests
    busy(table, clock, "10.0.0.2", "b3")
    assert table.victim("10.0.0.1") is None  # a holds 4, b 3
    assert table.victim("10.0.0.2") == "b1"  # its own idle one
    assert table.victim("10.0.0.3") == "b1"
    table.set_state("a4", ConnState.IDLE)
    assert table.victim("10.0.0.1") == "a4"


def test_busy_connections_are_shared_out_without_back_and_forth(clock):
    """Newcomers of three peers, in turn, at a cap of 9 that one peer filled with busy
    connections: each takes a place until the shares are even, then every newcomer is refused;
    no peer ever loses a connection to a newcomer of its own."""
    table = table_of(clock, max_connections=9)
    busy(table, clock, "10.0.0.1", *(f"a{i}" for i in range(9)))
    peers = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    for turn in range(30):
        peer = peers[turn % 3]
        victim = table.victim(peer)
        if victim is not None:
            assert table._conns[victim][0].key != peer
            table.remove(victim)
            busy(table, clock, peer, f"n{turn}")
    assert sorted(table.held_by(peer) for peer in peers) == [3, 3, 3]
    assert all(table.victim(peer) is None for peer in peers)
    assert table.victim("10.0.0.4") == table.victim("10.0.0.5") is not None  # a new peer: 0 < 3


def test_two_peers_one_connection_apart_keep_their_places(clock):
    table = table_of(clock, max_connections=5)
    busy(table, clock, "10.0.0.1", "a1", "a2", "a3")
    busy(table, clock, "10.0.0.2", "b1", "b2")
    assert table.victim("10.0.0.2") is None  # b would hold 3 to a's 2: a would take it back
    assert table.victim("10.0.0.3") == "a1"


@pytest.mark.parametrize("host,key", [
    ("192.0.2.7", "192.0.2.7"), ("::ffff:192.0.2.7", "192.0.2.7"),
    ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"), ("2001:db8:1:2:bbbb::9", "2001:db8:1:2::/64"),
    ("fe80::1%eth0", "fe80::/64"), ("", ""), (None, ""), ("some-name", "some-name")])
def test_a_peer_is_an_ipv4_address_or_an_ipv6_64(host, key):
    assert peer_key(host) == key
