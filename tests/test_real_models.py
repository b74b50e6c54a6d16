"""Every implementation and AUTO on real architectures, against the float64 brute force.

The zoo (``tests/zoo.py``): torchvision's ResNet-18, MobileNetV3-small, EfficientNet-B0 (slow) and a
small VisionTransformer, a timm ViT, Hugging Face BERT (also with peft LoRA adapters: the kernel over
the adapters) and GPT-2 with padding masks and an output selector, nn.TransformerEncoder, nn.MultiheadAttention, nn.LSTM and nn.GRU, a weight-norm
parametrization, a tied autoencoder using ``W.T``, and forward hooks; each with ``vmap_axes`` 0
(or the keyword-argument form) and None, traced and full kernels. Models and inputs are built on
the CPU and moved to the run device (``pytest --device``).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import torchntk
from tests import zoo
from tests.cases import DEVICE, to_device
from torchntk.testing import ModuleSnapshot, assert_kernels_close, reference_ntk

IMPLEMENTATIONS = (1, 2, 3, 0)
TRACES = {"traced": (-1,), "full": ()}


@functools.lru_cache(maxsize=None)
def _case(name: str) -> zoo.Case:
    torch.manual_seed(0)
    case = {**zoo.FAST, **zoo.SLOW}[name]()
    return case._replace(module=case.module.to(DEVICE), x1=to_device(case.x1), x2=to_device(case.x2),
                         kwargs=to_device(case.kwargs))


@functools.lru_cache(maxsize=None)
def _reference(name: str, trace: str) -> torch.Tensor:
    case = _case(name)
    inputs1, inputs2 = zoo.reference_inputs(case)
    return reference_ntk(zoo.ReferenceModule(case), inputs1, inputs2, trace_axes=TRACES[trace])


def _check_zoo_model(name: str, implementation: int) -> None:
    case = _case(name)
    snapshot = ModuleSnapshot.of(case.module)
    for trace in TRACES:
        for vmap_axes in (case.vmap_axes, None):
            ntk_fn = torchntk.empirical_ntk_fn(
                case.module, trace_axes=TRACES[trace], vmap_axes=vmap_axes, implementation=implementation,
                output_fn=case.output_fn,
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", torchntk.ExampleLoopWarning)
                kernel = ntk_fn(case.x1, case.x2, **case.kwargs)
            expected = _reference(name, trace)
            assert_kernels_close(kernel.double(), expected, rtol=1e-4, atol=1e-5 * expected.abs().max().item())
    snapshot.assert_unchanged()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", sorted(zoo.FAST))
def test_zoo_model_against_reference(name: str, implementation: int) -> None:
    _check_zoo_model(name, implementation)


@pytest.mark.slow
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", sorted(zoo.SLOW))
def test_large_zoo_model_against_reference(name: str, implementation: int) -> None:
    _check_zoo_model(name, implementation)
