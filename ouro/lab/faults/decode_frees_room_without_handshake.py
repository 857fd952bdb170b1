from .patch import Fault

FAULT = Fault(
    name="decode_frees_room_without_handshake",
    description="the decode side frees a room that timed out mid-transfer at once, without the prefill worker's answer",
    file="ouro/disagg/rooms.py", function="RoomTable.abort",
    replace=[("writer, freed = room.writer, False", "writer, freed = room.writer, True   # FAULT: no handshake")],
    localised=[{"file": "ouro/disagg/rooms.py", "function": ["abort", "expire"]}],
    probes=[["disagg", "--model", "tiny"]],
    symptom="under load with timeouts, a few disaggregated replies read like another request's text",
)
