"""Fused multiply-add with a single rounding, for Numba code.

Python 3.11 has no ``math.fma`` and Numba offers none, so we ask LLVM for its
``llvm.fma.f32`` / ``llvm.fma.f64`` intrinsic directly.  LLVM guarantees that
``llvm.fma`` computes ``a*b + c`` as if with infinite precision and rounds once
(on x86-64 with FMA3 it becomes one ``vfmadd`` instruction; elsewhere it falls
back to libm's correctly rounded ``fma``).

Numba without ``fastmath`` never contracts ``a*b + c`` on its own, so a fused
operation appears in the oracle only where the definition writes ``fma``.

The three arguments must share one type, float32 or float64: a mixed call would
silently promote to float64 and round twice, which is a different operation.
"""

from llvmlite import ir
from numba import njit, types
from numba.core.errors import TypingError
from numba.extending import intrinsic

__all__ = ["fma", "fma_py"]


@intrinsic
def fma(typingctx, a, b, c):
    """fma(a, b, c) = round(a*b + c), one rounding; usable only inside @njit code."""
    if not (a == b == c and a in (types.float32, types.float64)):
        raise TypingError(
            f"fma needs three float32 or three float64 arguments, got ({a}, {b}, {c}); "
            "convert explicitly (float32 -> float64 is exact, the reverse rounds)"
        )

    def codegen(context, builder, signature, args):
        llvm_type = context.get_value_type(signature.return_type)
        fn_type = ir.FunctionType(llvm_type, [llvm_type, llvm_type, llvm_type])
        fn = builder.module.declare_intrinsic("llvm.fma", [llvm_type], fn_type)
        return builder.call(fn, args)

    return a(a, a, a), codegen


@njit(cache=True)
def fma_py(a, b, c):
    """Python-callable fma.  Pass np.float32 scalars for the float32 operation,
    Python floats / np.float64 for the float64 one (the result comes back as a
    Python float; its value is exactly the float32 or float64 result)."""
    return fma(a, b, c)
