"""Where kernel entries go.

- ``kernel_layout``: :class:`KernelLayout`, the one place that turns ``trace_axes`` and
  ``diagonal_axes`` into a contraction;
- ``tiles``: where a block of examples lands in a kernel;
- ``runs``: runs of examples, the pairs of runs ``batch`` computes and the rows a rank keeps.
"""
