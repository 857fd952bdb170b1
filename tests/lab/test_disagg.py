"""`ouro probe disagg`: on clean ouro the stressed prefill/decode handoff (rooms timing out
mid-transfer, aborts on both sides) gives only correct outputs or clean errors and returns every
page and slot; with the decode side freeing a receiving room without the writer's answer (the
reference stack's slot-reuse race), the late writes are found and located in the room table."""

from ouro.disagg.rooms import RoomState, RoomTable
from ouro.lab.disagg_check import check
from ouro.models.resolve import resolve_model


def test_clean_handoff_under_stress_has_no_finding():
    f = check(str(resolve_model("tiny", progress=False)), requests=24)
    assert [x.severity for x in f] == ["info"], [x.summary for x in f]
    assert "completed and checked" in f[0].summary and "rooms timed out" in f[0].summary
    timed_out = int(f[0].summary.split("(")[1].split(" rooms")[0])
    assert timed_out > 0                  # every third prefill stalls past its room's deadline


def test_freeing_a_receiving_room_without_the_handshake_is_found(monkeypatch):
    def abort_at_once(self, rid, reason="aborted"):   # the planted fault: no answer awaited
        with self.lock:
            room = self.rooms.get(rid)
            if room is None or room.state not in (RoomState.RESERVED, RoomState.RECEIVING):
                return "unknown"
            if room.state is RoomState.RESERVED:
                self._close(room, reason)
            else:
                room.state, room.reason = RoomState.ABORTING, reason
        self.on_event("free", room, reason)
        return "freed"
    monkeypatch.setattr(RoomTable, "abort", abort_at_once)
    f = check(str(resolve_model("tiny", progress=False)), requests=24)
    top = f[0]
    assert top.severity == "error" and "written into rooms already freed" in top.summary, [x.summary for x in f]
    assert top.where["file"] == "ouro/disagg/rooms.py" and top.where["function"] == "abort"
