"""The decode side's rooms: memory a prefill worker may still write is never freed under it.
Freed at once only before the writer was answered `go`; after that only on the writer's last word
(done / failed / aborted) or its connection's end; `done` on an incomplete state frees with an
error instead of reaching decode. Every path is driven through the table's own entry points."""

import pytest

from ouro.disagg.rooms import RoomState, RoomTable

DSA, KDA = [3], [0, 1, 2]
PROMPT = 40


class Writer:
    """The decode side's end of a prefill connection, as the table uses it: control frames out."""

    def __init__(self):
        self.sent = []

    def send_control(self, header):
        self.sent.append(header)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@pytest.fixture
def table():
    events = []
    clock = Clock()
    t = RoomTable(DSA, KDA, lambda kind, room, reason: events.append((kind, room.rid, reason)), clock)
    t.events, t.now = events, clock
    return t


def fill(table, rid, conn, upto=PROMPT, states=True):
    table.received(rid, conn, 3, 0, 25, False)
    table.received(rid, conn, 3, 25, upto, upto == PROMPT)
    if states:
        for layer in KDA:
            table.received(rid, conn, layer, 25, PROMPT, True)


def test_complete_transfer_is_handed_to_the_engine(table):
    w = Writer()
    table.reserve("a", [4, 5, 6], 1, PROMPT, 0, timeout_s=5)
    assert table.hello("a", w) and table.rooms["a"].state is RoomState.RECEIVING
    fill(table, "a", w)
    table.finished("a", w, "done", {"first_token": 9})
    assert table.events == [("ready", "a", None)]
    room = table.take("a")
    assert room.result["first_token"] == 9 and room.pages == [4, 5, 6] and len(table) == 0


def test_before_go_a_room_frees_at_once_and_a_late_hello_is_refused(table):
    table.reserve("a", [1], 0, PROMPT, 0, timeout_s=5)
    assert table.abort("a") == "freed" and table.events == [("free", "a", "aborted")]
    assert not table.hello("a", Writer())                      # nothing may be written now
    table.reserve("b", [2], 1, PROMPT, 0, timeout_s=5)
    table.now.t += 6
    assert table.expire() == ["b"] and table.events[-1][:2] == ("free", "b") and "timed out" in table.events[-1][2]
    assert not table.hello("b", Writer())


@pytest.mark.parametrize("answer", ["aborted", "failed", "closed", "done"])
def test_after_go_an_abort_or_timeout_waits_for_the_writer(table, answer):
    w = Writer()
    table.reserve("a", [1, 2], 0, PROMPT, 0, timeout_s=5)
    table.hello("a", w)
    table.received("a", w, 3, 0, 25, False)
    table.now.t += 6
    assert table.expire() == ["a"]
    assert w.sent == [{"type": "abort", "rid": "a"}]
    assert table.events == [] and table.rooms["a"].state is RoomState.ABORTING   # still the writer's
    table.received("a", w, 3, 25, PROMPT, True)                                  # writes may still land
    if answer == "closed":
        table.connection_closed(w)
    else:
        fill(table, "a", w)
        table.finished("a", w, answer, {"message": "prefill failed"} if answer == "failed" else {})
    assert [e[:2] for e in table.events] == [("free", "a")] and "a" not in table.rooms


def test_done_on_an_incomplete_state_frees_with_an_error(table):
    for rid, upto, states in [("rows", 30, True), ("states", PROMPT, False)]:
        w = Writer()
        table.reserve(rid, [1], 0, PROMPT, 0, timeout_s=5)
        table.hello(rid, w)
        fill(table, rid, w, upto, states)
        table.finished(rid, w, "done", {"first_token": 1})
    assert [e[:2] for e in table.events] == [("free", "rows"), ("free", "states")]
    assert "layer 3 rows up to 30" in table.events[0][2] and "no final state for layers [0, 1, 2]" in table.events[1][2]


def test_rows_out_of_order_or_from_another_connection(table):
    w, other = Writer(), Writer()
    table.reserve("a", [1], 0, PROMPT, 8, timeout_s=5)          # 8 tokens held already: rows start there
    table.hello("a", w)
    assert table.destination("a", other) is None and table.destination("a", w) is not None
    table.received("a", other, 3, 8, PROMPT, True)               # not its room: not booked
    assert table.rooms["a"].covered[3] == 8
    table.received("a", w, 3, 9, PROMPT, True)                   # a gap
    for layer in KDA:
        table.received("a", w, layer, 9, PROMPT, True)
    table.finished("a", w, "done", {})
    assert table.events[0][:2] == ("free", "a") and "do not follow 8" in table.events[0][2]


def test_a_closed_connection_frees_only_its_own_rooms(table):
    w1, w2 = Writer(), Writer()
    for rid, w in [("a", w1), ("b", w2)]:
        table.reserve(rid, [1], 0, PROMPT, 0, timeout_s=5)
        table.hello(rid, w)
    table.reserve("c", [2], 1, PROMPT, 0, timeout_s=5)
    table.connection_closed(w1)
    assert [e[:2] for e in table.events] == [("free", "a")] and set(table.rooms) == {"b", "c"}
    with pytest.raises(ValueError, match="already has a room"):
        table.reserve("b", [3], 2, PROMPT, 0, timeout_s=5)
