"""Programmatic dependent launch (PDL, sm_90 and later) for the kernels of a launch-bound chain:
the dispatch and combine path, where a small batch's kernels take a few microseconds each and the
gap between two of them (launch, CTAs made resident, first loads issued) is a good part of it.

A kernel that calls :func:`chained` first is launched with the PDL attribute (TileLang sees the
wait and sets it), so the GPU may launch it, and make its CTAs resident, while the kernel before it
in the stream still runs; it then waits (``griddepcontrol.wait``) until that kernel has completed
and its memory is visible, and it lets the kernel after it launch the same way. Without PDL
(another caller's stream, an older GPU's launch) both instructions do nothing. CUDA graphs keep
the overlap (captured as programmatic edges).

TileLang drops ``__restrict__`` from the pointers of a kernel that waits (a read-only load could
otherwise be hoisted above the wait), so a memory-bound kernel's large-shape time is measured
before it joins the chain.
"""

from tilelang import language as T


@T.macro
def chained():
    """The first statement of a chained kernel's body. Nothing may come before the wait: a CTA that
    returned early would let its grid complete ahead of the kernel before it, and the next kernel's
    wait would then no longer cover that one."""
    T.pdl_trigger()  # the next kernel may launch now; its own wait keeps it behind this one
    T.pdl_sync()
