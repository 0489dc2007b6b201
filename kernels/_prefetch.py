"""Software prefetches for numba kernels (LLVM intrinsics).

* ``prefetch(array, i)``: the cache line of ``array[i]``.
* ``prefetch_lines(array, start, stop)``: every cache line that ``array[start:stop]`` touches (a
  flat array), for rows wider than one line: a dim-64 FTRL row is 768 bytes, twelve lines, and
  fetching only its first left the other eleven to miss one after another. A span of at most
  ``NARROW_VALUES`` (:mod:`hpcps_kernels.tuning`) values gets its first line only, as ``prefetch(array, start)``.

Hash-table probes are chains of dependent cache misses; prefetching the entries of queries a few
iterations ahead lets those misses overlap. A prefetch is only a hint: it never faults and never
changes results.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .tuning import NARROW_VALUES

LINE = 64  # bytes


def _prefetch_call(builder, ptr):
    i8p = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)
    fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
    # (address, rw = read, locality = keep in all levels, cache = data)
    builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])


@intrinsic
def prefetch(typingctx, arr, idx):
    sig = types.void(arr, idx)

    def codegen(context, builder, signature, args):
        aryty, _ = signature.args
        ary = context.make_array(aryty)(context, builder, args[0])
        index = context.cast(builder, args[1], signature.args[1], types.intp)  # any integer type
        _prefetch_call(builder, cgutils.get_item_pointer(context, builder, aryty, ary, [index]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def prefetch_lines(typingctx, arr, start, stop):
    sig = types.void(arr, start, stop)

    def codegen(context, builder, signature, args):
        aryty, sty, ety = signature.args
        ary = context.make_array(aryty)(context, builder, args[0])
        start = context.cast(builder, args[1], sty, types.intp)
        stop = context.cast(builder, args[2], ety, types.intp)
        intp = context.get_value_type(types.intp)
        itemsize = context.get_abi_sizeof(context.get_data_type(aryty.dtype))
        with builder.if_then(builder.icmp_signed(">", stop, start)):
            first = builder.ptrtoint(cgutils.get_item_pointer(context, builder, aryty, ary, [start]), intp)
            last = builder.add(first, builder.sub(builder.mul(builder.sub(stop, start), intp(itemsize)), intp(1)))
            mask = intp(~(LINE - 1))
            first_line = builder.and_(first, mask)
            count = builder.add(builder.lshr(builder.sub(builder.and_(last, mask), first_line), intp(6)), intp(1))
            narrow = builder.icmp_signed("<=", builder.sub(stop, start), intp(NARROW_VALUES))
            count = builder.select(narrow, intp(1), count)
            byte_ptr = ir.IntType(8).as_pointer()
            with cgutils.for_range(builder, count, intp=intp) as loop:
                addr = builder.add(first_line, builder.mul(loop.index, intp(LINE)))
                _prefetch_call(builder, builder.inttoptr(addr, byte_ptr))
        return context.get_dummy_value()

    return sig, codegen
