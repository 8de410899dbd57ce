"""LLVM instructions the numba kernels call by name (bit counts, the high half of a product): one definition
each, for :mod:`deltasync.kernels.cpu` and :mod:`deltasync.kernels.rans`."""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

__all__ = ["clz", "cttz", "mulhi"]


def _count_zeros(llvm_name: str):
    """The typing and code of a 64-bit count of zero bits (``llvm.ctlz.i64`` or ``llvm.cttz.i64``), the input
    known non-zero (the instruction's "zero is poison" flag off, so 0 gives 64 either way)."""
    sig = types.uint64(types.uint64)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(64), ir.IntType(1)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, llvm_name)
        return builder.call(fn, [args[0], ir.Constant(ir.IntType(1), 0)])

    return sig, codegen


@intrinsic
def clz(typingctx, x):
    """Count of leading zero bits of a uint64 (llvm.ctlz)."""
    return _count_zeros("llvm.ctlz.i64")


@intrinsic
def cttz(typingctx, x):
    """Count of trailing zero bits of a uint64 (llvm.cttz)."""
    return _count_zeros("llvm.cttz.i64")


@intrinsic
def mulhi(typingctx, a, b):
    """High 64 bits of the 128-bit product of two uint64 (one ``mul`` instruction)."""
    sig = types.uint64(types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        i128 = ir.IntType(128)
        p = builder.mul(builder.zext(args[0], i128), builder.zext(args[1], i128))
        return builder.trunc(builder.lshr(p, ir.Constant(i128, 64)), ir.IntType(64))

    return sig, codegen
