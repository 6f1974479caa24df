"""The PTX that skips the d512 kernel's output rescale, held to its operand layout exactly (a
miswired operand would multiply by the wrong row's factor only on the GPU): outputs tied to the
accumulator values, then the rows' factors, then the warp's decision."""

from __future__ import annotations

import pytest

pytest.importorskip("triton.experimental.gluon")

from spanattn.backends.triton import gluon_rescale as gr  # noqa: E402


def test_two_values_multiply_in_place_or_jump_past():
    assert gr._skip_asm(2) == (
        "{ .reg .pred p; setp.eq.s32 p, $6, 0; @p bra.uni SKIP${:uid}; "
        "mul.f32 $0, $0, $4; mul.f32 $1, $1, $5; SKIP${:uid}: }"
    )
    assert gr._skip_constraints(2) == "=r,=r,0,1,r,r,r,r"


def test_the_shipped_asm_covers_a_threads_128_values():
    asm, constraints = gr.SKIP_ASM.value, gr.SKIP_CONSTRAINTS.value
    assert asm.count("mul.f32") == 128 and "mul.f32 $127, $127, $383;" in asm and "$384, 0;" in asm
    assert constraints.split(",") == ["=r"] * 128 + [str(i) for i in range(128)] + ["r"] * 256
