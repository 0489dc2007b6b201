"""A kernel's compiled function for given argument types, called without numba's dispatch.

Each call of a numba kernel types every argument (``typeof``) and looks the types up among the
kernel's compiled versions before it runs: for a kernel of 12 arguments about a microsecond, as
long as the work of a 100-key pull. A caller that makes the same call many times with arguments
of unchanging types (a server's pulls of one table) runs it once through the dispatch
(:func:`run_and_find`), which compiles or loads what it always would, and then calls the
version the dispatch chose: the same machine code, so the same results, bit for bit. It must
then keep to those types: arrays of the same dtype, dimensions and layout (contiguity,
alignment, writeability), scalars of the same kind; its arguments are not checked.
"""

from __future__ import annotations

from numba import typeof


def run_and_find(kernel, args: tuple, packed: bool = False) -> tuple:
    """Run numba kernel ``kernel`` on ``args`` through its dispatch; returns (its result, the
    compiled version it ran, a callable taking arguments of ``args``' types), or the kernel itself
    in place of the version where the dispatch ran one made for other types (converting these).

    ``packed``: the last of ``args`` is the tuple of the arguments the kernel takes as ``*args``
    (a rule's hyper-parameters), as its compiled version takes them; the callable returned takes
    ``args`` so too, whichever it is."""
    if not packed:
        result = kernel(*args)
        found = kernel.overloads.get(tuple(typeof(a) for a in args))
        return result, (kernel if found is None else found.entry_point)
    result = kernel(*args[:-1], *args[-1])
    found = kernel.overloads.get(tuple(typeof(a) for a in args))
    return result, ((lambda *a: kernel(*a[:-1], *a[-1])) if found is None else found.entry_point)
