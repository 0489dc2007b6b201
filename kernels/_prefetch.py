"""``prefetch(array, i)``: a software prefetch of ``array[i]`` for numba kernels (LLVM intrinsic).

Hash-table probes are chains of dependent cache misses; prefetching the entries of queries a few
iterations ahead lets those misses overlap. A prefetch is only a hint: it never faults and never
changes results.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def prefetch(typingctx, arr, idx):
    sig = types.void(arr, idx)

    def codegen(context, builder, signature, args):
        aryty, _ = signature.args
        ary = context.make_array(aryty)(context, builder, args[0])
        index = context.cast(builder, args[1], signature.args[1], types.intp)  # any integer type
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [index])
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        # (address, rw = read, locality = keep in all levels, cache = data)
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return sig, codegen
