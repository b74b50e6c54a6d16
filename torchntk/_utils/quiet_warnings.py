"""PyTorch's warnings that torchntk answers itself, silenced while torchntk computes.

NOTE: [Known PyTorch warnings]
``torch.func.vmap`` warns "There is a performance drop because we have not yet implemented the
batching rule for aten::<op>" when an operation has no batching rule and it falls back to a loop
over the batch. For a few operations torchntk knows that path, computes the right kernel through
it and has nothing better to offer: the fused CPU attention kernels of
``scaled_dot_product_attention``, which every Hugging Face BERT or GPT-2 reaches, and the fast paths
of ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` in eval mode (the structured and
forward-mode paths already restrict attention to its MATH kernel, and turn the fast paths off,
where they must; see ``_model/unfused.py``). The warning
then names an operation the user never called and asks them to file an issue with PyTorch, on
every kernel of such a model. The second is PyTorch's own use of ``torch.jit.script``: forward-mode
AD (implementation 2, the forward-mode checks, ``empirical_ntk_vp_fn``) scripts decompositions on its
first use, and ``torch.jit.script`` warns that it is deprecated, a ``DeprecationWarning`` up to torch
2.13 (hidden by default) and a ``FutureWarning`` from 2.14 (shown): it asks the user to migrate code
they never wrote. :func:`known_warnings_silenced` ignores exactly those messages (for the
operations of :data:`KNOWN_OPERATIONS`, and ``torch.jit.script``'s deprecation), and only while
torchntk computes: a kernel function's
call or ``auto_choice`` (``KernelFunction``, ``_kernel/kernel_function.py``, through which every
kernel passes), and the two entry points that compute without one, sketched features
(``sketch/__init__.py``) and the NTK-vector products of spectra (``spectra/_operator.py``). Every
other warning, the model's own included, reaches the user unchanged.

Threads: ``warnings.catch_warnings`` saves and restores the whole process-wide filter list, so two
threads computing kernels at once (``batch``'s workers, a user's thread pool) would restore each
other's lists, and one could leave a filter behind or drop a filter the user added meanwhile. So
the filter is instead inserted once, by the first of any number of concurrent computations, and
removed by identity by the last (``_utils/threads.WhileAnyActive``), without touching the rest of
the list.
Filters are process-wide, so while any thread computes a kernel, the same PyTorch messages for
these operations are silenced on the other threads too; nothing else is.

The filters' version is not bumped (``warnings.filterwarnings`` would): bumping resets every
module's record of the warnings it already showed, so a "shown once" warning of the user's would
be shown again after every kernel call. None is needed, because an ignored warning is not recorded
as shown (CPython 3.9 and later), so nothing remains of the filter once it is removed.
"""

from __future__ import annotations

import re
import warnings
from typing import Callable, ContextManager

from .threads import WhileAnyActive

KNOWN_OPERATIONS = (
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_native_multi_head_attention",
    "_transformer_encoder_layer_fwd",
)
"""ATen operations whose vmap fallback torchntk takes knowingly (NOTE: [Known PyTorch warnings])."""

_MESSAGE = (
    r"There is a performance drop because we have not yet implemented the batching rule for "
    rf"aten::(?:{'|'.join(map(re.escape, KNOWN_OPERATIONS))})\."
)

# The filters as ``warnings.filterwarnings`` would store them; objects of their own, so that they are
# removed by identity and never an equal filter of the user's.
_FILTERS = (
    ("ignore", re.compile(_MESSAGE, re.I), UserWarning, None, 0),
    ("ignore", re.compile(r"`torch\.jit\.script` is deprecated", re.I), Warning, None, 0),
)

_silenced = WhileAnyActive()


def known_warnings_silenced() -> ContextManager[None]:
    """Ignores PyTorch's batching-rule warnings for :data:`KNOWN_OPERATIONS` inside the block;
    reentrant and thread-safe (NOTE: [Known PyTorch warnings])."""
    return _silenced.active(_insert)


def _insert() -> Callable[[], None]:
    filters = warnings.filters
    filters[:0] = _FILTERS

    def undo() -> None:
        # A catch_warnings block entered meanwhile may have swapped the list: the filter goes from
        # the list it went into and from the current one.
        _remove(filters)
        if warnings.filters is not filters:
            _remove(warnings.filters)

    return undo


def _remove(filters: list) -> None:
    for index in range(len(filters) - 1, -1, -1):
        if any(filters[index] is known for known in _FILTERS):
            del filters[index]
