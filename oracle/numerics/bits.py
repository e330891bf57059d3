"""Bit casts between floats and their IEEE-754 encodings, for Numba code.

Each cast reinterprets the bits (LLVM ``bitcast``); nothing is converted or
rounded.  The types are checked strictly so that a float64 can never slip into
a float32 cast through an implicit conversion: ``f32_to_bits`` takes exactly a
float32, ``bits_to_f32`` exactly a uint32, and likewise for the 64-bit pair.
Numba widens uint32 arithmetic to uint64, so callers write ``np.uint32(expr)``
where they mean 32 bits.
"""

from llvmlite import ir
from numba import types
from numba.core.errors import TypingError
from numba.extending import intrinsic

__all__ = ["f32_to_bits", "bits_to_f32", "f64_to_bits", "bits_to_f64"]


def _bitcast(name, from_type, to_type, width):
    def typer(typingctx, x):
        if x != from_type:
            raise TypingError(f"{name} takes exactly {from_type}, got {x}")

        def codegen(context, builder, signature, args):
            target = ir.IntType(width) if isinstance(to_type, types.Integer) else (
                ir.FloatType() if width == 32 else ir.DoubleType())
            return builder.bitcast(args[0], target)

        return to_type(from_type), codegen

    typer.__name__ = name
    typer.__doc__ = f"{name}(x: {from_type}) -> {to_type}: reinterpret the {width} bits."
    return intrinsic(typer)


f32_to_bits = _bitcast("f32_to_bits", types.float32, types.uint32, 32)
bits_to_f32 = _bitcast("bits_to_f32", types.uint32, types.float32, 32)
f64_to_bits = _bitcast("f64_to_bits", types.float64, types.uint64, 64)
bits_to_f64 = _bitcast("bits_to_f64", types.uint64, types.float64, 64)
