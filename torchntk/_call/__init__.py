"""One validated kernel call and its two sides.

- ``kernel_call``: :class:`KernelCall`, a call checked once (inputs, outputs, layout, groups);
- ``per_example``: a side's per-example evaluation (under ``vmap`` or an example loop);
- ``vmap_axes`` and ``vmap_check``: parsing ``vmap_axes`` and checking it on outputs and
  derivatives;
- ``example_loop``: the per-example loop for models ``vmap`` cannot evaluate;
- ``groups`` and ``outputs``: parameter groups and the kernels a call returns;
- ``blocks``: ``chunk_size``'s assembly of a kernel from blocks of examples.
"""
