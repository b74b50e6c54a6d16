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
from unittest import mock

import pytest
import torch

import torchntk
from tests import zoo
from tests.cases import DEVICE, to_device
from torchntk._kernel import preparation
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


def _check_defaults(name: str) -> None:
    """``empirical_ntk_fn(model)(x1, x2)`` with nothing else given (NOTE: [Found vmap_axes]): the
    exact kernel, the examples mapped as the case's own ``vmap_axes`` map them."""
    case = _case(name)
    snapshot = ModuleSnapshot.of(case.module)
    ntk_fn = torchntk.empirical_ntk_fn(case.module, output_fn=case.output_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torchntk.ExampleLoopWarning)
        kernel = ntk_fn(case.x1, case.x2, **case.kwargs)
        choice = ntk_fn.auto_choice(case.x1, case.x2, **case.kwargs)
    expected = _reference(name, "traced")
    assert_kernels_close(kernel.double(), expected, rtol=1e-4, atol=1e-5 * expected.abs().max().item())
    assert choice.vmap_axes is not None, choice.vmap_axes_reason
    assert choice.vmap_axes[2] == (case.vmap_axes[2] if isinstance(case.vmap_axes, tuple) else None)
    # NOTE: [Plans shared by kernel functions]: built again, its first call is bound to these plans
    prepared = []
    original = preparation.prepare_call
    with mock.patch.object(preparation, "prepare_call", lambda *args, **kwargs: prepared.append(1) or original(*args, **kwargs)):
        again = torchntk.empirical_ntk_fn(case.module, output_fn=case.output_fn)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torchntk.ExampleLoopWarning)
            kernel = again(case.x1, case.x2, **case.kwargs)
    assert not prepared, "a kernel function built again plans its first call anew"
    assert_kernels_close(kernel.double(), expected, rtol=1e-4, atol=1e-5 * expected.abs().max().item())
    assert again.auto_choice(case.x1, case.x2, **case.kwargs).implementation == choice.implementation
    snapshot.assert_unchanged()


@pytest.mark.parametrize("name", sorted(zoo.FAST))
def test_zoo_model_with_the_defaults(name: str) -> None:
    _check_defaults(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(zoo.SLOW))
def test_large_zoo_model_with_the_defaults(name: str) -> None:
    _check_defaults(name)


@pytest.mark.slow
def test_resnet18_in_training_mode_with_the_defaults() -> None:
    """As constructed (training mode): batch statistics couple the examples, so the kernel is that
    of the model as called on the whole batch, and its running statistics stay as they were."""
    torch.manual_seed(0)
    case = zoo.resnet18()
    # float64: batch statistics of 2 or 3 examples over layer4's 1x1 maps are ill-conditioned, and
    # float32 rounding there moves the kernel by its own size
    module = case.module.train().double().to(DEVICE)
    x1, x2 = to_device(case.x1.double()), to_device(case.x2.double())
    snapshot = ModuleSnapshot.of(module)
    with pytest.warns(UserWarning, match=r"training mode, BatchNorm2d at 'bn1' \(batch statistics\).*model.eval\(\)"):
        kernel = torchntk.empirical_ntk_fn(module)(x1, x2)
    snapshot.assert_unchanged()
    expected = reference_ntk(module, x1, x2)
    assert_kernels_close(kernel, expected, rtol=1e-8, atol=1e-10 * expected.abs().max().item())
