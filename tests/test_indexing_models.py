"""Models that read other examples by indexing (node-level graph networks) under ``vmap_axes``.

Such a model treats each node as an example, but its forward pass gathers the features of other
nodes (``x[edge_index[0]]``) and sums them into each node: one node alone, as vmap shows it to the
model, does not hold the rows the indices point to, so the per-example evaluation raises
(IndexError, or whatever the model's library makes of vmap's RuntimeError; torch_geometric raises
IndexError). The default ``vmap_axes="auto"`` must then compute on whole batches and say why
(``auto_choice(...).vmap_axes_reason``); an explicit ``vmap_axes=0`` must be a ValueError saying
the examples are coupled. A model whose examples are independent but whose library turns vmap's
error into another exception must still get its kernel, through the example loop.

Every kernel is checked against the float64 brute force of ``torchntk.testing.reference_ntk``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import torchntk
from tests import zoo
from tests.cases import to_device
from torchntk.testing import assert_kernels_close, reference_ntk

F64 = torch.float64
IMPLEMENTATIONS = pytest.mark.parametrize("implementation", [0, 1, 2, 3], ids=["AUTO", "JC", "NVP", "SD"])
NODES = 6
# A ring with a chord: every node reads another one, and the number of edges (7) differs from the
# number of nodes, so that no check mistakes edge_index for a per-example argument.
EDGES = ((0, 1, 2, 3, 4, 5, 0), (1, 2, 3, 4, 5, 0, 3))


def _gather_rows(x: torch.Tensor, index: torch.Tensor, how: str) -> torch.Tensor:
    if how == "subscript":
        return x[index]
    if how == "index_select":
        return x.index_select(0, index)
    return x.gather(0, index[:, None].expand(-1, x.shape[1]))


class _NodeMessagePassing(nn.Module):
    """One round of message passing over a fixed graph, each node an example: every node adds the
    features of the nodes with an edge into it (gathered by ``gather``, summed by ``index_add_`` or
    ``scatter_add``), then a two-layer head. Errors of the gathering are raised as IndexError, as
    torch_geometric raises them."""

    def __init__(self, gather: str = "subscript", scatter: str = "index_add_") -> None:
        super().__init__()
        self.register_buffer("edge_index", torch.tensor(EDGES))
        self.gather, self.scatter = gather, scatter
        self.inner = nn.Linear(3, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        source, target = self.edge_index
        h = torch.tanh(self.inner(x))
        try:
            messages = _gather_rows(h, source, self.gather)
        except (IndexError, RuntimeError) as error:
            raise IndexError(f"edge_index points outside the {h.shape[0]} nodes given") from error
        if self.scatter == "index_add_":
            summed = torch.zeros_like(h).index_add_(0, target, messages)
        else:
            summed = torch.zeros_like(h).scatter_add(0, target[:, None].expand_as(messages), messages)
        return self.head(h + summed)


def _model(**options: str) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return to_device(_NodeMessagePassing(**options).double())


def _nodes(seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return to_device(torch.randn(NODES, 3, generator=generator, dtype=F64))


@IMPLEMENTATIONS
@pytest.mark.parametrize("x2_given", [True, False], ids=["x2", "x2-None"])
def test_the_default_call_computes_on_whole_batches(implementation, x2_given):
    model = _model()
    x1, x2 = _nodes(1), (_nodes(2) if x2_given else None)
    ntk_fn = torchntk.empirical_ntk_fn(model, implementation=implementation)
    kernel = ntk_fn(x1, x2)
    assert_kernels_close(kernel, reference_ntk(model, x1, x2), rtol=1e-10)
    assert_kernels_close(ntk_fn(x1, x2), kernel, rtol=1e-12)  # a later call, planned
    choice = ntk_fn.auto_choice(x1, x2)
    assert choice.vmap_axes is None
    assert "IndexError: edge_index points outside the 1 nodes given" in choice.vmap_axes_reason
    assert "couples examples" in choice.vmap_axes_reason


@pytest.mark.parametrize("gather", ["subscript", "index_select", "gather"])
@pytest.mark.parametrize("scatter", ["index_add_", "scatter_add"])
def test_every_way_of_indexing_is_handled(gather, scatter):
    model = _model(gather=gather, scatter=scatter)
    x1 = _nodes()
    kernel = torchntk.empirical_ntk_fn(model, trace_axes=())(x1)
    assert_kernels_close(kernel, reference_ntk(model, x1, None, trace_axes=()), rtol=1e-10)
    with pytest.raises(ValueError, match=r"`vmap_axes` says examples are independent, but the model fails "
                                         r"when evaluated per example under vmap.*couples examples.*vmap_axes=None"):
        torchntk.empirical_ntk_fn(model, vmap_axes=0, trace_axes=())(x1)


class _Unconverted(nn.Module):
    """Adds the last node's features to every node, read by a plain subscript whose IndexError
    (PyTorch's own) passes through."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x + x[[NODES - 1]])


@IMPLEMENTATIONS
def test_explicit_vmap_axes_on_coupled_examples_is_a_clear_value_error(implementation):
    model = _model()
    x1, x2 = _nodes(1), _nodes(2)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation)
    with pytest.raises(ValueError) as raised:
        ntk_fn(x1, x2)
    message = str(raised.value)
    assert message.startswith("ntk_fn: `vmap_axes` says examples are independent")
    assert "couples examples" in message and "Pass vmap_axes=None" in message
    assert message.endswith("Under vmap it raised IndexError: edge_index points outside the 1 nodes given")
    # what the message says to pass gives the right kernel
    unmapped = torchntk.empirical_ntk_fn(model, vmap_axes=None, implementation=implementation)
    assert_kernels_close(unmapped(x1, x2), reference_ntk(model, x1, x2), rtol=1e-10)
    # PyTorch's own IndexError, not converted by the model, is diagnosed the same way
    plain = to_device(_Unconverted().double())
    with pytest.raises(ValueError, match=r"couples examples.*Under vmap it raised IndexError: index"):
        torchntk.empirical_ntk_fn(plain, vmap_axes=0, implementation=implementation)(x1)
    found = torchntk.empirical_ntk_fn(plain, implementation=implementation)
    assert_kernels_close(found(x1), reference_ntk(plain, x1), rtol=1e-10)


class _Writes(nn.Module):
    """Independent examples, written in place into a fresh tensor (which vmap cannot batch), with
    vmap's RuntimeError turned into a TypeError as some libraries do."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        out = torch.zeros(h.shape, dtype=h.dtype, device=h.device)
        try:
            out.copy_(h)
        except RuntimeError as error:
            raise TypeError("this layer cannot write batched tensors") from error
        return torch.tanh(out)


@IMPLEMENTATIONS
@pytest.mark.parametrize("vmap_axes", ["auto", 0])
def test_independent_examples_whose_error_was_converted_go_through_the_loop(implementation, vmap_axes):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = to_device(_Writes().double())
    x1, x2 = _nodes(1), _nodes(2)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=vmap_axes, implementation=implementation)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernel = ntk_fn(x1, x2)
    loops = [str(w.message) for w in caught if issubclass(w.category, torchntk.ExampleLoopWarning)]
    assert_kernels_close(kernel, reference_ntk(model, x1, x2), rtol=1e-10)
    choice = ntk_fn.auto_choice(x1, x2)
    if vmap_axes == "auto" and choice.vmap_axes is None:  # whole batches priced cheaper (NOTE: [Loop or whole batches])
        assert not loops and "(vmap: inplace" in choice.vmap_axes_reason
    else:
        assert len(loops) == 1 and "cannot evaluate this model per example (vmap: inplace" in loops[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", torchntk.ExampleLoopWarning)  # once per kernel function
        assert_kernels_close(ntk_fn(x1, x2), kernel, rtol=1e-12)


class _Interrupting(nn.Module):
    """Raises what must never be taken for a failure of vmap: the user's interrupt, or no memory."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.error = error

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch._C._functorch.is_batchedtensor(x):
            raise self.error
        return self.linear(x)


@pytest.mark.parametrize("error", [KeyboardInterrupt(), MemoryError()], ids=["interrupt", "memory"])
def test_interrupts_and_memory_errors_pass_unchanged(error):
    model = to_device(_Interrupting(error).double())
    with pytest.raises(type(error)):
        torchntk.empirical_ntk_fn(model)(_nodes())
    with pytest.raises(type(error)):
        torchntk.empirical_ntk_fn(model, vmap_axes=0)(_nodes())


# -- torch_geometric itself -------------------------------------------------------------------------


class _GinNodes(nn.Module):
    """torch_geometric's GINConv on a fixed graph, then a linear head: one output row per node."""

    def __init__(self, geometric) -> None:
        super().__init__()
        self.register_buffer("edge_index", torch.tensor(EDGES))
        self.conv = geometric.nn.GINConv(nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 8)), train_eps=True)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.conv(x, self.edge_index)))


@IMPLEMENTATIONS
def test_torch_geometric_gin_per_node(implementation):
    geometric = zoo.optional("torch_geometric")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = to_device(_GinNodes(geometric).double())
    x1, x2 = _nodes(1), _nodes(2)
    ntk_fn = torchntk.empirical_ntk_fn(model, implementation=implementation)
    for second in (x2, None):
        assert_kernels_close(ntk_fn(x1, second), reference_ntk(model, x1, second), rtol=1e-10)
    choice = ntk_fn.auto_choice(x1, x2)
    assert choice.vmap_axes is None and "IndexError" in choice.vmap_axes_reason
    with pytest.raises(ValueError, match=r"couples examples.*Under vmap it raised IndexError"):
        torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation)(x1, x2)
