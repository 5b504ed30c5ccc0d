import triton
import triton.language as tl


@triton.jit
def e4m3_to_f16_asm(x):
    """uint8 e4m3 codes -> fp16 via packed cvt in inline asm (opaque to Triton, so the conversion stays
    before the shared-memory staging of dot operands)."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b16 lo, hi;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi;
        }""",
        constraints="=r,=r,r",
        args=[x],
        dtype=tl.float16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def e4m3x2_to_f16_pair(x):
    """int16 holding two e4m3 codes (low byte = even dim, high byte = odd dim) -> (even fp16, odd fp16).
    One packed cvt per pair; Triton moves the int16 tile through shared memory like any 16-bit dot operand."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 r;
        cvt.rn.f16x2.e4m3x2 r, $2;
        mov.b32 {$0, $1}, r;
        }""",
        constraints="=h,=h,h",
        args=[x],
        dtype=(tl.float16, tl.float16),
        is_pure=True,
        pack=1,
    )
