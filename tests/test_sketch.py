"""Sketched NTK features (``torchntk.sketched_ntk_features_fn``, ``torchntk.sketched_ntk_fn``).

Three kinds of checks:

* exact: the features equal ``fold(J Omega)`` with ``J`` a float64 Jacobian from
  ``torch.autograd.functional.jacobian`` and ``Omega`` the dense projection assembled here from the
  documented seeded streams, for every projection (this pins the conv2d and linear Kronecker
  algebra, the traced-axis signs and the layouts to the estimator's definition);
* statistical: the mean over fixed seeds of the estimate approaches the float64 reference NTK
  (``torchntk.testing.reference_ntk``) within a few standard errors, estimated from the same draws;
* reproducibility: batch size, chunking, vmap or not, and dtype do not change the features.

Models, inputs and the dense projections live on the run device (``pytest --device``); the
projections' streams are the same on every device.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import torchntk
from tests.cases import DEVICE, to_device
from torchntk.sketch import _projections as streams
from torchntk.testing import ModuleSnapshot, assert_kernels_close, reference_ntk

PROJECTIONS = ("gaussian", "sparse", "kronecker")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double().to(DEVICE).eval()


class _ConvNet(nn.Module):
    """Convolutions with groups, stride, dilation, string and reflect padding, a bias-free one, then a head."""

    def __init__(self):
        super().__init__()
        self.grouped = nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2)
        self.dilated = nn.Conv2d(6, 4, 3, padding="same", padding_mode="reflect", dilation=2)
        self.plain = nn.Conv2d(4, 3, 2, bias=False)
        self.head = nn.Linear(27, 3)

    def forward(self, x):
        h = torch.tanh(self.grouped(x))
        h = torch.tanh(self.dilated(h))
        return self.head(self.plain(h).flatten(1))


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return _ConvNet().double().to(DEVICE).eval()


class _Transposed(nn.Module):
    """A weight used through ``W.t()`` (no Kronecker capture) beside an ordinary Linear."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(x @ self.weight.t()))


class _HiddenUse(nn.Module):
    """``linear.weight`` is used a second time under DisableTorchFunction, invisible to a function mode."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        h = self.linear(x)
        with torch._C.DisableTorchFunction():
            h = h + torch.nn.functional.linear(x.flip(-1), self.linear.weight)
        return self.head(torch.tanh(h))


def _inputs(model: nn.Module, n: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    shape = (n, 4, 8, 8) if isinstance(model, _ConvNet) else (n, 3)
    return to_device(torch.randn(shape, generator=generator, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------
# Exact: features = fold(J Omega) with Omega assembled from the documented streams
# ---------------------------------------------------------------------------------------------


def _jacobian(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """``J[n, o, p]``: float64 Jacobian of the ``(N, O)`` output with respect to all parameters."""
    named = [(name, param.detach()) for name, param in model.named_parameters()]

    def output(*values):
        params = {name: value for (name, _), value in zip(named, values)}
        return torch.func.functional_call(model, params, (x,))

    blocks = torch.autograd.functional.jacobian(output, tuple(value for _, value in named))
    flat = torch.cat([block.reshape(*block.shape[:2], -1) for block in blocks], dim=-1)
    return flat, named


def _dense_projection(named, k: int, projection: str, seed: int, kronecker: set[str], traced: int = 0) -> torch.Tensor:
    """The ``(P, k)`` projection the features use, assembled tile by tile (NOTE: [Sketch streams]);
    a CountSketch has one per traced output coordinate ``traced``."""
    like = torch.zeros((), dtype=torch.float64, device=DEVICE)
    parts = []
    for name, param in named:
        numel = param.numel()
        omega = torch.zeros(numel, k, dtype=torch.float64, device=DEVICE)
        if projection == "kronecker" and name in kronecker:
            out_size, in_size = param.shape[0], numel // param.shape[0]
            for block, start, width in streams.column_blocks(k):
                out_factor, in_factor = streams.kronecker_factors(seed, name, out_size, in_size, block, width, like)
                for j in range(width):
                    omega[:, start + j] = torch.outer(out_factor[:, j], in_factor[:, j]).reshape(-1)
        elif projection == "sparse":
            for row_block, row_start, rows in streams.row_blocks(numel):
                buckets, signs = streams.sparse_hash(seed, name, row_block, rows, k, traced, like)
                omega[row_start + torch.arange(rows, device=DEVICE), buckets] = signs
        else:
            for row_block, row_start, rows in streams.row_blocks(numel):
                for block, start, width in streams.column_blocks(k):
                    tile = streams.gaussian_tile(seed, name, row_block, rows, block, width, like)
                    omega[row_start:row_start + rows, start:start + width] = tile
        parts.append(omega)
    return torch.cat(parts)


def _expected_features(model, x, k, projection, seed, traced: bool, kronecker: set[str]) -> torch.Tensor:
    jacobian, named = _jacobian(model, x)
    outputs = jacobian.shape[1]
    if projection == "sparse" and traced:
        return sum(jacobian[:, t] @ _dense_projection(named, k, projection, seed, kronecker, t)
                   for t in range(outputs)) / math.sqrt(outputs)
    projected = jacobian @ _dense_projection(named, k, projection, seed, kronecker)   # (N, O, k)
    if projection != "sparse":
        projected = projected / math.sqrt(k)
    if not traced:
        return projected
    signs = torch.cat([streams.trace_signs(seed, outputs, block, width, projected)
                       for block, _, width in streams.column_blocks(k)], dim=1)
    return torch.einsum("noj,oj->nj", projected, signs) / math.sqrt(outputs)


@pytest.mark.parametrize("projection", PROJECTIONS)
@pytest.mark.parametrize("traced", [True, False], ids=["traced", "full"])
@pytest.mark.parametrize("make_model", [_mlp, _conv_net], ids=["mlp", "conv"])
def test_features_are_the_documented_projection_of_the_jacobian(make_model, traced, projection):
    model = make_model()
    x = _inputs(model, 3)
    k = 200  # two column blocks, the second one partial
    kronecker = {name for name, param in model.named_parameters() if param.ndim >= 2}
    features_fn = torchntk.sketched_ntk_features_fn(
        model, k, trace_axes=(-1,) if traced else (), vmap_axes=0, projection=projection, seed=7
    )
    expected = _expected_features(model, x, k, projection, 7, traced, kronecker)
    assert_kernels_close(features_fn(x), expected)


def test_a_weight_used_other_than_by_linear_gets_the_gaussian_projection():
    torch.manual_seed(0)
    model = _Transposed().double().to(DEVICE)
    x = _inputs(model, 3)
    kronecker = torchntk.sketched_ntk_features_fn(model, 64, vmap_axes=0, projection="kronecker")(x)
    expected = _expected_features(model, x, 64, "kronecker", 0, True, {"head.weight"})
    assert_kernels_close(kronecker, expected)


def test_a_weight_with_a_use_hidden_from_the_capture_gets_the_gaussian_projection():
    torch.manual_seed(0)
    model = _HiddenUse().double().to(DEVICE)
    x = _inputs(model, 3)
    for vmap_axes in (0, None):
        kronecker = torchntk.sketched_ntk_features_fn(model, 64, vmap_axes=vmap_axes, projection="kronecker")(x)
        assert_kernels_close(kronecker, _expected_features(model, x, 64, "kronecker", 0, True, {"head.weight"}))


def test_a_functional_model_names_its_parameters_by_leaf():
    model = _mlp()
    params = {name: param.detach() for name, param in model.named_parameters()}
    x = _inputs(model, 3)

    def f(p, inputs):
        return torch.func.functional_call(model, p, (inputs,))

    features = torchntk.sketched_ntk_features_fn(f, 32, vmap_axes=0, projection="gaussian")(x, params)
    jacobian, named = _jacobian(model, x)  # torch's pytree keeps a dict's insertion order
    renamed = [(f"params leaf {index}", value) for index, (_, value) in enumerate(named)]
    projected = jacobian @ _dense_projection(renamed, 32, "gaussian", 0, set()) / math.sqrt(32)
    signs = streams.trace_signs(0, 2, 0, 32, projected)
    assert_kernels_close(features, torch.einsum("noj,oj->nj", projected, signs) / math.sqrt(2))


# ---------------------------------------------------------------------------------------------
# Statistical: unbiased, and accurate for large k
# ---------------------------------------------------------------------------------------------


def _estimates(model, x1, x2, trace_axes, projection) -> torch.Tensor:
    """Independent ``k = 16`` estimates of the NTK of x1 and x2: 1200, or 300 for CountSketch.

    The columns of a Gaussian or Kronecker sketch are independent (independent projection entries
    and trace signs per column), so every seed gives 60 disjoint groups of 16 columns, each an
    estimate once rescaled by ``k / 16``. CountSketch columns share the hashing of each parameter
    entry, so there each estimate has a seed of its own.
    """
    seeds, k = (range(300), 16) if projection == "sparse" else (range(20), 960)
    x = torch.cat([x1, x2])
    estimates = []
    for seed in seeds:
        features_fn = torchntk.sketched_ntk_features_fn(
            model, k, trace_axes=trace_axes, vmap_axes=0, projection=projection, seed=seed, check_vmap_axes=False
        )
        phi1, phi2 = features_fn(x).split([len(x1), len(x2)])
        for group in torch.arange(k, device=DEVICE).split(16):
            equation = "nj,mj->nm" if trace_axes else "naj,mbj->nmab"
            estimates.append(torch.einsum(equation, phi1[..., group], phi2[..., group]) * (k / 16))
    return torch.stack(estimates)


@pytest.mark.parametrize("projection", PROJECTIONS)
@pytest.mark.parametrize("trace_axes", [(-1,), ()], ids=["traced", "full"])
def test_the_mean_of_independent_estimates_is_the_exact_ntk_within_standard_errors(projection, trace_axes):
    """The mean of ``S`` independent estimates of an entry is within ``z`` standard errors of its
    expectation except with probability about ``2 Phi(-z)``; the draws are fixed, so the test is
    deterministic. 4.5 standard errors over the 12 (or 48) entries would be exceeded with
    probability below 1e-3 were the estimator unbiased. Its power, measured on these draws: scaling
    the estimates by 1.05 gives 6-6.5 standard errors with S = 1200 (4.8 with CountSketch's
    S = 300), dropping the signs that fold the traced logits 7.6-8 (4.4); the deterministic tests
    above pin the exact values anyway."""
    model = _mlp()
    x1, x2 = _inputs(model, 3, seed=1), _inputs(model, 4, seed=2)
    samples = _estimates(model, x1, x2, trace_axes, projection)
    exact = reference_ntk(model, x1, x2, trace_axes=trace_axes)
    standard_error = samples.std(0) / math.sqrt(len(samples))
    z = (samples.mean(0) - exact).abs() / standard_error
    assert z.max() < 4.5, z
    # the standard errors are those of k=16 sketches: neither zero nor absurd
    assert (standard_error < 0.1 * exact.abs().max()).all() and (standard_error > 0).all()


@pytest.mark.parametrize("projection", PROJECTIONS)
def test_large_k_gives_a_small_relative_error(projection):
    model = _conv_net()
    x1, x2 = _inputs(model, 3, seed=1), _inputs(model, 2, seed=2)
    exact = reference_ntk(model, x1, x2)
    estimate = torchntk.sketched_ntk_fn(model, 4096, vmap_axes=0, projection=projection)(x1, x2)
    # about sqrt(2 / k) = 0.022 of the kernel's scale for a Gaussian sketch; 0.1 leaves room for
    # the larger variance of CountSketch and Kronecker sketches on these small gradients
    assert (estimate - exact).norm() < 0.1 * exact.norm()


# ---------------------------------------------------------------------------------------------
# Reproducibility
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("projection", PROJECTIONS)
def test_features_do_not_depend_on_the_batch_or_the_chunking(projection):
    model = _conv_net()
    x = _inputs(model, 5)
    whole = torchntk.sketched_ntk_features_fn(model, 96, vmap_axes=0, projection=projection, seed=3)(x)
    for chunk_size in (1, 2):
        chunked = torchntk.sketched_ntk_features_fn(
            model, 96, vmap_axes=0, projection=projection, seed=3, chunk_size=chunk_size
        )
        assert_kernels_close(chunked(x), whole)
        assert_kernels_close(torch.cat([chunked(x[:2]), chunked(x[2:])]), whole)
    unmapped = torchntk.sketched_ntk_features_fn(model, 96, projection=projection, seed=3)(x)
    assert_kernels_close(unmapped, whole)


@pytest.mark.parametrize("projection", PROJECTIONS)
def test_same_seed_same_features_other_seed_other_features(projection):
    model = _mlp()
    x = _inputs(model, 4)
    features_fn = torchntk.sketched_ntk_features_fn(model, 64, vmap_axes=0, projection=projection, seed=5)
    assert torch.equal(features_fn(x), features_fn(x))
    again = torchntk.sketched_ntk_features_fn(model, 64, vmap_axes=0, projection=projection, seed=5)(x)
    assert torch.equal(again, features_fn(x))
    other = torchntk.sketched_ntk_features_fn(model, 64, vmap_axes=0, projection=projection, seed=6)(x)
    assert not torch.allclose(other, features_fn(x), rtol=0.1)


def test_the_features_are_a_module_property_not_a_dtype_one():
    model = _mlp()
    x = _inputs(model, 4)
    double = torchntk.sketched_ntk_features_fn(model, 64, vmap_axes=0)(x)
    single = torchntk.sketched_ntk_features_fn(model.float(), 64, vmap_axes=0)(x.float())
    assert single.dtype == torch.float32
    assert_kernels_close(single, double.float())


@pytest.mark.parametrize("projection", ["gaussian", "kronecker"])
def test_more_gaussian_columns_extend_the_sketch(projection):
    model = _mlp()
    x = _inputs(model, 3)
    small = torchntk.sketched_ntk_features_fn(model, 100, vmap_axes=0, projection=projection)(x)
    large = torchntk.sketched_ntk_features_fn(model, 300, vmap_axes=0, projection=projection)(x)
    assert_kernels_close(large[:, :100] * math.sqrt(300), small * math.sqrt(100))


def test_the_kernel_layout_of_sketched_ntk_fn():
    model = _conv_net()
    x1, x2 = _inputs(model, 3, seed=1), _inputs(model, 2, seed=2)
    full = torchntk.sketched_ntk_features_fn(model, 32, trace_axes=(), vmap_axes=0)
    phi1, phi2 = full(x1), full(x2)                                                  # (N, O, k)
    kernel = torchntk.sketched_ntk_fn(model, 32, trace_axes=(), vmap_axes=0)(x1, x2)
    assert_kernels_close(kernel, torch.einsum("naj,mbj->nmab", phi1, phi2))
    diagonal = torchntk.sketched_ntk_fn(model, 32, trace_axes=(), diagonal_axes=(-1,), vmap_axes=0)(x1, x2)
    assert_kernels_close(diagonal, torch.einsum("naj,maj->nma", phi1, phi2))
    per_example = torchntk.sketched_ntk_fn(model, 32, trace_axes=(), diagonal_axes=(0, 1), vmap_axes=0)(x1)
    assert_kernels_close(per_example, torch.einsum("naj,naj->na", phi1, phi1))
    traced = torchntk.sketched_ntk_features_fn(model, 32, vmap_axes=0)(x1)
    assert_kernels_close(torchntk.sketched_ntk_fn(model, 32, vmap_axes=0)(x1), traced @ traced.T)


@pytest.mark.parametrize("projection", ["gaussian", "kronecker"])
def test_sketched_ntk_fn_is_a_kernel_function_that_batch_tiles(projection):
    """Like every builder, ``sketched_ntk_fn`` returns a ``KernelFunction``: ``batch`` tiles it
    (blocks of the same features) and ``replicate`` rebuilds it with every option."""
    model = _mlp()
    x1, x2 = to_device(torch.randn(7, 3, dtype=torch.float64)), to_device(torch.randn(5, 3, dtype=torch.float64))
    ntk_fn = torchntk.sketched_ntk_fn(model, 64, trace_axes=(), vmap_axes=0, projection=projection, seed=3)
    assert isinstance(ntk_fn, torchntk.KernelFunction)
    assert ntk_fn.spec.kind == "ntk" and ntk_fn.spec.f is model and ntk_fn.spec.trace_axes == ()
    whole = ntk_fn(x1, x2)
    assert_kernels_close(torchntk.batch(ntk_fn, batch_size=3)(x1, x2), whole)
    assert_kernels_close(torchntk.batch(ntk_fn, batch_size=2)(x1), ntk_fn(x1))
    assert_kernels_close(ntk_fn.replicate(x1.device)(x1, x2), whole)


def test_pytree_outputs_get_features_per_leaf():
    model = _mlp()

    def f(params, x):
        out = torch.func.functional_call(model, params, (x,))
        return {"logits": out, "first": out[:, :1] * 2}

    params = {name: p.detach() for name, p in model.named_parameters()}
    x = _inputs(model, 3)
    features = torchntk.sketched_ntk_features_fn(f, 16, vmap_axes=0)(x, params)
    assert features["logits"].shape == (3, 16) and features["first"].shape == (3, 16)
    kernel = torchntk.sketched_ntk_fn(f, 16, vmap_axes=0)(x, None, params)
    assert_kernels_close(kernel["first"], features["first"] @ features["first"].T)


def test_keyword_arguments_reach_the_model_and_two_tuples_are_split():
    model = _mlp()
    params = {name: p.detach() for name, p in model.named_parameters()}

    def f(p, x, scale):
        return torch.func.functional_call(model, p, (x * scale,))

    x1, x2 = _inputs(model, 3, seed=1), _inputs(model, 2, seed=2)
    features_fn = torchntk.sketched_ntk_features_fn(f, 16, vmap_axes=0)
    kernel = torchntk.sketched_ntk_fn(f, 16, vmap_axes=0)(x1, x2, params, scale=(1.0, 2.0))
    assert_kernels_close(kernel, features_fn(x1, params, scale=1.0) @ features_fn(x2, params, scale=2.0).T)


def test_the_model_is_left_unchanged():
    model = _mlp()
    snapshot = ModuleSnapshot.of(model)
    torchntk.sketched_ntk_fn(model, 32, vmap_axes=0, projection="kronecker")(_inputs(model, 3))
    snapshot.assert_unchanged()


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arguments, error, match",
    [
        (dict(k=0), ValueError, r"sketched_ntk_features_fn: `k` \(the number of features\) must be a positive int, "
                                r"got 0"),
        (dict(k=-3), ValueError, r"`k` .* positive int, got -3"),
        (dict(k=2.5), TypeError, r"`k` .* positive int, got 2.5 \(float\)"),
        (dict(k=True), TypeError, r"`k` .* got True \(bool\)"),
        (dict(k=8, projection="dense"), ValueError,
         r"`projection` must be one of 'gaussian', 'sparse', 'kronecker', got 'dense'"),
        (dict(k=8, projection=None), TypeError, r"`projection` must be one of .* got None"),
        (dict(k=8, seed=-1), ValueError, r"`seed` must be 0 or positive, got -1"),
        (dict(k=8, seed=1.0), TypeError, r"`seed` must be a non-negative int"),
        (dict(k=8, chunk_size=0), ValueError, r"`chunk_size` must be None or a positive int"),
        (dict(k=8, trace_axes="x"), TypeError, r"`trace_axes` must be an int or a sequence of ints"),
        (dict(k=8, check_vmap_axes=1), TypeError, r"`check_vmap_axes` must be True or False"),
    ],
)
def test_bad_arguments_raise_at_build_time(arguments, error, match):
    with pytest.raises(error, match=match):
        torchntk.sketched_ntk_features_fn(_mlp(), **arguments)


def test_bad_calls_raise_clear_errors():
    model = _mlp()
    x = _inputs(model, 3)
    with pytest.raises(ValueError, match=r"features_fn: `trace_axes`=\(0,\) contains the batch axis 0"):
        torchntk.sketched_ntk_features_fn(model, 8, trace_axes=0, vmap_axes=0)(x)
    with pytest.raises(ValueError, match=r"features_fn: `trace_axes`=\(2,\) has axis 2, out of range"):
        torchntk.sketched_ntk_features_fn(model, 8, trace_axes=2, vmap_axes=0)(x)
    with pytest.raises(ValueError, match=r"ntk_fn: `diagonal_axes`=\(-1, 1\) names the same axis of the output"):
        torchntk.sketched_ntk_fn(model, 8, trace_axes=(), diagonal_axes=(-1, 1), vmap_axes=0)(x)
    with pytest.raises(ValueError, match=r"ntk_fn: `trace_axes`=\(-1,\) and `diagonal_axes`=\(1,\) both contain "):
        torchntk.sketched_ntk_fn(model, 8, diagonal_axes=1, vmap_axes=0)(x)
    with pytest.raises(ValueError, match=r"ntk_fn: the output has diagonal axis 0 of size 3 for x1 but 2 for x2"):
        torchntk.sketched_ntk_fn(model, 8, diagonal_axes=0, vmap_axes=0)(x, x[:2])
    with pytest.raises(TypeError, match=r"features_fn: `x` must be a tensor or a pytree of tensors"):
        torchntk.sketched_ntk_features_fn(model, 8, vmap_axes=0)(x.cpu().numpy())
