"""tools/ncu_blocks.py reads ncu's per-SASS CSV export: opcodes, stall sums and basic blocks of each kernel."""
from __future__ import annotations

import csv

from tools.ncu_blocks import by_line, main, opcode, read, read_disasm, summary

HEADER = ["Address", "Source", "# Samples", "Instructions Executed", "stall_short_sb", "stall_wait",
          "stall_short_sb (Not Issued)"]


def write_export(path, kernels):
    """kernels: [(name, [(source, executed, short_sb, wait)])] -> the export's layout (a name line, a header,
    one row per instruction)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        for name, rows in kernels:
            w.writerow(["Kernel Name", name])
            w.writerow(HEADER)
            for i, (src, n, sb, wt) in enumerate(rows):
                w.writerow([hex(0x1000 + 16 * i), src, sb + wt, n, sb, wt, 999])


def test_opcodes_stalls_and_blocks(tmp_path, capsys):
    loop = [("FFMA R1, R2, R3, R1", 64, 5, 1)] * 3 + [("@!P0 LDS.128 R4, [R2+0x10]", 64, 9, 0), ("BRA 0x1000", 64, 0, 2)]
    once = [("MOV R1, RZ", 2, 0, 0), ("EXIT", 2, 1, 0)]
    rows = once[:1] + loop + once[1:]
    other = [("DFMA R2, R4, R6, R2", 7, 3, 3)]
    p = tmp_path / "k.csv"
    write_export(p, [("k_one", rows), ("k_two", other)])
    ks = read(str(p))
    assert [k.name for k in ks] == ["k_one", "k_two"]
    s = summary(ks[0])
    assert s["instructions"] == sum(n for _, n, _, _ in rows)
    ops = dict(s["ops"])
    assert ops["FFMA"] == 3 * 64 and ops["LDS"] == 64 and ops["MOV"] == 2 and ops["EXIT"] == 2
    stalls = dict(s["stalls"])  # the "(Not Issued)" column is not summed in
    assert stalls == {"short_sb": sum(r[2] for r in rows), "wait": sum(r[3] for r in rows)}
    n, length, mix = s["blocks"][0]  # the loop: five instructions executed 64 times each
    assert (n, length, mix["FFMA"], mix["LDS"], mix["BRA"]) == (64, len(loop), 3, 1, 1)
    assert main([str(p), "--blocks", "2"]) == 0
    out = capsys.readouterr().out
    assert "== k_one" in out and "== k_two" in out and f"block of {len(loop)} executed 64 times" in out


def test_opcode_and_an_export_without_kernels(tmp_path, capsys):
    assert opcode("@!UP1 IMAD.WIDE.U32 R2, R3, 0x4, R4") == "IMAD"
    assert opcode("  LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64]") == "LDGSTS"
    p = tmp_path / "empty.csv"
    p.write_text("==PROF== nothing here\n")
    assert main([str(p)]) == 1 and "no kernel" in capsys.readouterr().err


def test_source_lines_from_the_disassembly(tmp_path, capsys):
    """--lines: the kernel is matched to the nvdisasm function with its instruction sequence (not its
    name), and its executed instructions, FFMAs and stall samples are summed per source line."""
    src = tmp_path / "k.cuh"
    src.write_text("// one\nacc = ffma(w, x, acc);\nwait();\n")
    rows = [("MOV R1, RZ", 2, 0, 0), ("FFMA R1, R2, R3, R1", 64, 5, 1), ("FFMA R4, R2, R3, R4", 64, 1, 1),
            ("BAR.SYNC 0x0", 64, 0, 7), ("EXIT", 2, 1, 0)]
    csvp = tmp_path / "k.csv"
    write_export(csvp, [("void k_one(Args)", rows)])

    def insn(i, text):
        return f"        /*{16 * i:04x}*/                   {text} ;\n"
    decoy = ".text._Z5decoyv:\n" + insn(0, "MOV R1, RZ") + insn(1, "EXIT")  # other instructions, same length class
    same_len = ".text._Z4nearv:\n" + "".join(insn(i, t) for i, t in enumerate(["MOV R1, RZ", "FADD R1, R1, R1",
                                                                                  "FFMA R4, R2, R3, R4", "BAR.SYNC 0x0", "EXIT"]))
    mine = (".text._Z5k_onev:\n" + insn(0, "MOV R1, RZ")
            + f'\t//## File "{src}", line 2\n' + insn(1, "FFMA R1, R2, R3, R1") + insn(2, "FFMA R4, R2, R3, R4")
            + f'\t//## File "{src}", line 3 inlined at "x.cu", line 9\n' + insn(3, "BAR.SYNC 0x0") + insn(4, "EXIT"))
    sass = tmp_path / "k.sass"
    sass.write_text(decoy + same_len + mine)
    funcs = read_disasm(str(sass))
    assert [len(v) for v in funcs.values()] == [2, 5, 5]
    name, ex, ff, st = by_line(read(str(csvp))[0], funcs)
    assert name == "_Z5k_onev"
    assert ex[(str(src), 2)] == 128 and ff[(str(src), 2)] == 128 and st[(str(src), 2)] == 8
    assert ex[(str(src), 3)] == 66 and ff[(str(src), 3)] == 0 and st[(str(src), 3)] == 8
    assert ex[None] == 2
    assert main([str(csvp), "--lines", str(sass), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "k.cuh:2" in out and "acc = ffma(w, x, acc);" in out and "k.cuh:3" in out
    write_export(csvp, [("void k_two(Args)", rows[:3])])
    assert main([str(csvp), "--lines", str(sass)]) == 0
    assert "no function of" in capsys.readouterr().out
