"""``output_fn`` selects what the kernel is taken of; non-tensor output leaves are dropped (NOTE:
[Selected outputs]). Models and inputs live on the run device (``pytest --device``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchntk
from tests.cases import DEVICE, to_device
from torchntk.testing import assert_kernels_close, reference_nngp, reference_ntk


class Cache:
    """Stands for a Hugging Face ``DynamicCache``: an object that is not a tensor."""


class TokenModel(nn.Module):
    """Returns a dict of per-position logits and a cache object, as language models do."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(11, 6)
        self.head = nn.Linear(6, 4)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
        hidden = torch.tanh(self.embedding(input_ids)) * attention_mask[..., None]
        return {"logits": self.head(hidden.cumsum(1)), "cache": Cache(), "steps": input_ids.shape[1]}


def last_token(output: dict, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    last = attention_mask.sum(-1) - 1
    return output["logits"][torch.arange(input_ids.shape[0], device=input_ids.device), last]


class Selected(nn.Module):
    """The reference's view of the same quantity: a module of ``(ids, mask)``."""

    def __init__(self, model: nn.Module, select) -> None:
        super().__init__()
        self.model, self.select = model, select

    def forward(self, inputs: tuple) -> torch.Tensor:
        ids, mask = inputs
        return self.select(self.model(ids, attention_mask=mask), ids, mask)


def _tokens():
    ids1, ids2 = torch.randint(0, 11, (4, 5)), torch.randint(0, 11, (3, 5))
    mask1, mask2 = torch.ones(4, 5, dtype=torch.long), torch.ones(3, 5, dtype=torch.long)
    mask1[0, 3:] = 0
    mask2[2, 2:] = 0
    return to_device((ids1, ids2, mask1, mask2))


@pytest.mark.parametrize("implementation", [1, 2, 3, 0])
@pytest.mark.parametrize("vmap_axes", [None, (0, 0, {"attention_mask": 0})])
def test_output_fn_with_inputs_against_reference(implementation, vmap_axes):
    model = TokenModel().to(DEVICE)
    ids1, ids2, mask1, mask2 = _tokens()
    ntk_fn = torchntk.empirical_ntk_fn(
        model, trace_axes=(), vmap_axes=vmap_axes, implementation=implementation, output_fn=last_token
    )
    kernel = ntk_fn(ids1, ids2, attention_mask=(mask1, mask2))
    expected = reference_ntk(Selected(model, last_token), (ids1, mask1), (ids2, mask2), trace_axes=())
    assert kernel.shape == (4, 3, 4, 4)
    assert_kernels_close(kernel, expected)


def test_output_fn_of_the_output_alone_and_a_logit_difference():
    model = TokenModel().to(DEVICE)
    ids1, ids2, mask1, mask2 = _tokens()

    def difference(output):
        return output["logits"][:, -1, 0] - output["logits"][:, -1, 1]

    vmap_axes = (0, 0, {"attention_mask": 0})
    kernel = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=vmap_axes, output_fn=difference)(
        ids1, ids2, attention_mask=(mask1, mask2)
    )
    expected = reference_ntk(Selected(model, lambda out, ids, mask: difference(out)), (ids1, mask1), (ids2, mask2), trace_axes=())
    assert kernel.shape == (4, 3)
    assert_kernels_close(kernel, expected)


def test_non_tensor_output_leaves_are_dropped():
    model = TokenModel().to(DEVICE)
    ids1, _, mask1, _ = _tokens()
    kernel = torchntk.empirical_ntk_fn(model, vmap_axes=(0, 0, {"attention_mask": 0}))(ids1, None, attention_mask=mask1)
    assert set(kernel) == {"logits", "cache", "steps"}
    assert kernel["cache"] is None and kernel["steps"] is None
    expected = reference_ntk(Selected(model, lambda out, ids, mask: out["logits"]), (ids1, mask1), None)
    assert_kernels_close(kernel["logits"], expected)


def test_output_fn_in_the_nngp_kernel_fn_and_ntk_vector_products():
    model = TokenModel().to(DEVICE)
    ids1, ids2, mask1, mask2 = _tokens()
    reference_model = Selected(model, last_token)
    nngp = torchntk.empirical_nngp_fn(model, output_fn=last_token)(ids1, ids2, attention_mask=(mask1, mask2))
    assert_kernels_close(nngp, reference_nngp(reference_model, (ids1, mask1), (ids2, mask2)))
    both = torchntk.empirical_kernel_fn(model, trace_axes=(), output_fn=last_token)(
        ids1, ids2, ("ntk", "nngp"), attention_mask=(mask1, mask2)
    )
    full = reference_ntk(reference_model, (ids1, mask1), (ids2, mask2), trace_axes=())
    assert_kernels_close(both.ntk, full)
    v = to_device(torch.randn(3, 4))
    product = torchntk.empirical_ntk_vp_fn(model, ids1, ids2, output_fn=last_token, attention_mask=(mask1, mask2))(v)
    assert_kernels_close(product, torch.einsum("nmab,mb->na", full, v.double()).float())


def test_output_fn_must_be_callable():
    with pytest.raises(TypeError, match="`output_fn` must be None or a callable"):
        torchntk.empirical_ntk_fn(nn.Linear(2, 2), output_fn="logits")
