"""The compiler: passes from program to program, run in this order."""
from shardfuse.passes.allocate import allocate_buffers
from shardfuse.passes.annotations import fold_annotations
from shardfuse.passes.bucket import bucket_allreduces
from shardfuse.passes.contiguity import stage_strided_views
from shardfuse.passes.cse import share_resharding
from shardfuse.passes.donate import donate_buffers
from shardfuse.passes.fold import fold_collectives
from shardfuse.passes.fuse import fuse_elementwise
from shardfuse.passes.fuse_rows import fuse_rows
from shardfuse.passes.keep import keep_gathered_inputs
from shardfuse.passes.lower import lower_to_host
from shardfuse.passes.pipeline import form_stream_loops, mark_stream_intermediates
from shardfuse.passes.propagate import propagate_sharding
from shardfuse.passes.reassociate import sum_before_reducing
from shardfuse.passes.reshard import insert_resharding
from shardfuse.passes.reuse import reuse_buffers
from shardfuse.passes.ring import lower_ring
from shardfuse.passes.split_stream import split_stream_axes
from shardfuse.passes.streams import assign_streams
from shardfuse.passes.verify import verify

PIPELINE = (
    fold_annotations,
    propagate_sharding,
    split_stream_axes,
    insert_resharding,
    sum_before_reducing,
    share_resharding,
    mark_stream_intermediates,
    lower_ring,
    form_stream_loops,
    lower_to_host,
    keep_gathered_inputs,
    bucket_allreduces,
    allocate_buffers,
    fold_collectives,
    stage_strided_views,
    fuse_elementwise,
    fuse_rows,
    donate_buffers,
    assign_streams,
    reuse_buffers,
    verify,
)


def compile_program(prog, stop_after: str | None = None):
    """Run the pipeline (or its prefix up to `stop_after`, for looking at one stage)."""
    for p in PIPELINE:
        prog = p(prog)
        if p.__name__ == stop_after:
            break
    return prog
