"""Helpers every layer uses: argument checks (``checks``), pytrees (``tree``), types (``types``),
a bounded cache, the TF32 policy (``precision``), locks (``threads``) and the marker for reads
that stay outside a graph capture (``capturing``)."""
