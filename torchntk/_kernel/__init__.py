"""The kernel function every builder returns and what stands behind it.

- ``kernel_function``: :class:`KernelFunction` (callable, ``auto_choice``, its spec for ``batch``
  and replicas);
- ``settings``: what one NTK kernel function validates once and shares between calls (preparing a
  call, the switch to example loops, dispatch to an implementation, publishing the result);
- ``block_source``: the blocks of a kernel as ``batch`` asks for them;
- ``captured``: ``compile=``'s capture of a whole call into one graph, and its replay.
"""
