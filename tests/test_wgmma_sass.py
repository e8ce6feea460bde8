"""The SASS checks of csrc/tools/wgmma_a_hazards.py on hand-written instruction lists (the tool
itself reads cuobjdump's output of a GPU build): writes to an HGMMA's pending A registers, and
the instructions a warp issues between an MMA group and the wait that completes it."""

from __future__ import annotations

import importlib.util
import os

_PATH = os.path.join(os.path.dirname(__file__), "..", "csrc", "tools", "wgmma_a_hazards.py")
_spec = importlib.util.spec_from_file_location("wgmma_a_hazards", _PATH)
sass = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass)

GROUP = [
    "HGMMA.64x64x16.F32.BF16 R24, R56, gdesc[UR8], R24",
    "HGMMA.64x64x16.F32.BF16 R24, R60, gdesc[UR8], R24, gsb0",
]
WAIT = "WARPGROUP.DEPBAR.LE gsb0, 0x0"


def test_a_write_to_a_pending_a_register_is_found_until_the_wait():
    ins = GROUP + ["LDS.128 R60, [R12]", "IADD3 R70, R1, R2, RZ", WAIT, "LDS.128 R56, [R13]"]
    assert sass.hazards(ins) == ["LDS.128 R60, [R12]"]  # R60-R63 feed the second HGMMA
    # A 64-bit write that reaches into a pending register counts too; stores write none.
    assert sass.hazards(GROUP + ["IMAD.WIDE R55, R1, R2, RZ"]) == ["IMAD.WIDE R55, R1, R2, RZ"]
    assert sass.hazards(GROUP + ["STS.128 [R56], R56", "BAR.SYNC.DEFER_BLOCKING 0x1, 0x80"]) == []


def test_the_instructions_between_a_group_and_its_wait_are_counted():
    decode = ["LOP3.LUT R7, R7, R8, RZ, 0x3c, !PT", "HMUL2.BF16_V2 R13, R68, R15.H1_H1", "NOP"]
    # The wait first, then the decode (what ptxas made of one B set): nothing overlaps but the
    # stage's wait; the decode before the wait (two sets): it overlaps.
    late = GROUP + ["SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R82+URZ], R5", WAIT] + decode
    early = GROUP + decode + ["STSM.16.M88.4 [R83], R16", WAIT]
    assert sass.overlaps(late + late) == [1, 1]
    assert sass.overlaps(early) == [3]  # NOP is not counted
    assert sass.overlaps(GROUP[:1] + [WAIT]) == []  # no group ended (no gsb0)
    assert sass.overlaps([WAIT] + GROUP) == []  # a group without a wait after it
