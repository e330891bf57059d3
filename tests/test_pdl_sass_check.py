"""tools/pdl_sass_check.py reads cuobjdump's SASS: the global memory instructions a kernel issues before its
first PDL wait (ACQBULK), for kernels that wait."""
from __future__ import annotations

import shutil

import pytest

from tools.pdl_sass_check import ALLOWED, early_loads, short_name


def function(name: str, lines: list[str]) -> str:
    """One function of cuobjdump -sass's listing: its header, then one instruction a line."""
    body = "\n".join(f"        /*{16 * i:04x}*/                   {op} ;" for i, op in enumerate(lines))
    return f"\n\t\tFunction : {name}\n\t.headerflags\t@\"EF_CUDA_SM90\"\n{body}\n"


SASS = "Fatbin elf code:\n" + "".join([
    function("_Z5earlyPKi", ["LDC R1, c[0x0][0x28]", "LDG.E.CONSTANT R5, desc[UR6][R4.64]", "PREEXIT", "ACQBULK",
                             "LDG.E R7, desc[UR6][R2.64]", "EXIT"]),
    function("_Z4latePKi", ["S2R R0, SR_TID.X", "ACQBULK", "LDG.E.CONSTANT R5, desc[UR6][R4.64]", "EXIT"]),
    function("_Z6nowaitPKi", ["LDG.E R5, desc[UR6][R4.64]", "EXIT"]),
    function("_Z5atomsPi", ["RED.E.ADD.STRONG.GPU desc[UR4][R2.64], R5", "ACQBULK", "EXIT"]),
])


def test_loads_before_the_wait_are_listed_and_only_those():
    got = early_loads(SASS)
    assert got == {"_Z5earlyPKi": ["LDG.E.CONSTANT"], "_Z5atomsPi": ["RED.E.ADD.STRONG.GPU"]}


@pytest.mark.skipif(shutil.which("c++filt") is None, reason="c++filt (binutils) is not installed")
def test_kernel_names_as_the_allow_list_spells_them():
    # glm::cuda::(anonymous namespace)::k_mla_olat_tiled(float const*, int, ...) and a template instance
    assert short_name("_ZN3glm4cuda12_GLOBAL__N_116k_mla_olat_tiledEPKfi") == "k_mla_olat_tiled"
    assert short_name("_ZN3glm4cuda12_GLOBAL__N_112k_hb_productILi1ELi1EEEvPKi") == "k_hb_product"
    assert set(ALLOWED) == {"k_mla_olat", "k_mla_olat_tiled"}
