"""lab/probes/ncu_sass_summary.py on a small Nsight Compute source-page export."""

import gzip

from lab.probes.ncu_sass_summary import summary

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_barrier","stall_wait",'
          '"stall_selected","stall_barrier (Not Issued)"')
ROWS = [  # a loop of three instructions run 1000 times, a prologue, and a parked warp's NOP
    '"0x10","FFMA R1, R2, R3, R4","30","1000","0","20","10","0"',
    '"0x20","MUFU.EX2 R5, R1","40","1000","0","30","10","0"',
    '"0x30","@!P0  BRA 0x10","10","999","5","5","0","0"',
    '"0x40","MOV R1, RZ","2","8","0","2","0","0"',
    '"0x50","NOP","118","2","118","0","0","0"',
]


def test_splits_the_loop_from_the_warps_that_only_wait(tmp_path):
    path = tmp_path / "sass.csv.gz"
    path.write_bytes(gzip.compress(('"Kernel Name","k",\n' + HEADER + "\n" + "\n".join(ROWS) + "\n").encode()))
    r = summary(path)
    assert r["stall_samples"] == 200
    assert r["loop"]["instructions"] == 3 and r["loop"]["share_of_samples"] == 0.4
    assert r["loop"]["stalls"] == {"wait": 0.688, "selected": 0.25, "barrier": 0.062}
    assert r["loop"]["opcodes"] == {"FFMA": 1, "MUFU.EX2": 1, "BRA": 1}
    assert r["rest"]["top"][0] == {"source": "NOP", "executed": 2.0, "share_of_samples": 0.59}
    # the loop's instructions by their share of the loop's samples, each with its main stall reason
    assert r["loop"]["top"][:2] == [{"source": "MUFU.EX2 R5, R1", "share_of_loop_samples": 0.5, "stall": "wait"},
                                    {"source": "FFMA R1, R2, R3, R4", "share_of_loop_samples": 0.375, "stall": "wait"}]
