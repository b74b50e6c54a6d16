"""Spectra without the kernel (Lanczos, Hutchinson) and kernel diagnostics, against float64 references.

The eigenpairs and traces are checked against ``torch.linalg.eigh`` and ``torch.trace`` of the
float64 brute-force kernel of ``torchntk.testing``; the diagnostics against closed forms on
hand-built matrices.

Models, inputs and hand-built operators live on the run device (``pytest --device``); random
entries are drawn on CPU generators and moved, so every device sees the same numbers.
"""

from __future__ import annotations

import math

import pytest
import torch

import torchntk
from tests.cases import cnn, mlp, to_device
from torchntk.testing import ModuleSnapshot, reference_ntk

# -- helpers written for the tests, independent of the library's layout code --------------------


def as_matrix(kernel: torch.Tensor) -> torch.Tensor:
    """A (N, N, A, A, B, B, ...) kernel as the (N A B.., N A B..) matrix, rows x1's coordinates."""
    pairs = kernel.ndim // 2
    rows = [2 * i for i in range(pairs)]
    columns = [2 * i + 1 for i in range(pairs)]
    side = math.prod(kernel.shape[0::2])
    return kernel.permute(*rows, *columns).reshape(side, side)


def kernel_times(kernel: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """The kernel, in its layout, applied to ``vectors`` of shape (*coordinates, k)."""
    pairs = kernel.ndim // 2
    rows = [2 * i for i in range(pairs)]
    columns = [2 * i + 1 for i in range(pairs)]
    return torch.tensordot(kernel.permute(*rows, *columns), vectors, dims=pairs)


def rotated(eigenvalues: list[float], seed: int = 0) -> torch.Tensor:
    """A symmetric float64 matrix with the given eigenvalues and random eigenvectors, on the run device.

    Built on the CPU and moved, so that it is the same matrix on every device.
    """
    generator = torch.Generator().manual_seed(seed)
    size = len(eigenvalues)
    basis, _ = torch.linalg.qr(torch.randn(size, size, generator=generator, dtype=torch.float64))
    return to_device((basis * torch.tensor(eigenvalues, dtype=torch.float64)) @ basis.T)


def inputs(case, n: int) -> torch.Tensor:
    return case.make_inputs(n, torch.Generator().manual_seed(1))


# -- Lanczos on the NTK against eigh of the reference kernel ------------------------------------

# (case, examples, trace_axes, kernel coordinates): traced and full kernels of an MLP and a CNN.
NTK_CASES = {
    "mlp-traced": (mlp, 60, (-1,), (60,)),
    "mlp-full": (mlp, 20, (), (20, 4)),
    "cnn-traced": (cnn, 3, (1,), (3, 6, 5)),
    "cnn-full": (cnn, 2, (), (2, 3, 6, 5)),
}


@pytest.mark.parametrize("name", NTK_CASES)
def test_ntk_eigenpairs_match_eigh_of_the_reference_kernel(name, device):
    make_case, n, trace_axes, coordinates = NTK_CASES[name]
    case = make_case()
    x = inputs(case, n)
    kernel = reference_ntk(case.module, x, None, trace_axes=trace_axes)
    matrix = as_matrix(kernel)
    expected_values, expected_vectors = torch.linalg.eigh(matrix)
    expected_values, expected_vectors = expected_values.flip(0), expected_vectors.flip(1)
    k = 5
    snapshot = ModuleSnapshot.of(case.module)

    pairs = torchntk.ntk_eigenpairs(case.module, x, k, trace_axes=trace_axes)

    snapshot.assert_unchanged()
    size = math.prod(coordinates)
    assert pairs.converged and pairs.products < size  # converged, not run until it spans everything
    assert pairs.eigenvalues.dtype == torch.float64 and pairs.eigenvectors.shape == (*coordinates, k)
    top = float(expected_values[0])
    torch.testing.assert_close(pairs.eigenvalues, expected_values[:k], rtol=1e-9, atol=1e-9 * top)
    # K v = lambda v with the reference kernel in its own layout, to the promised tolerance.
    residuals = kernel_times(kernel, pairs.eigenvectors) - pairs.eigenvectors * pairs.eigenvalues
    residual_norms = residuals.reshape(size, k).norm(dim=0)
    assert (residual_norms <= 1e-7 * top).all(), residual_norms
    torch.testing.assert_close(residual_norms, pairs.residuals, rtol=1e-3, atol=1e-12 * top)
    # Unit eigenvectors equal to eigh's up to sign (the spectra here have no close eigenvalues).
    overlaps = (pairs.eigenvectors.reshape(size, k) * expected_vectors[:, :k]).sum(0).abs()
    torch.testing.assert_close(overlaps, torch.ones(k, dtype=torch.float64, device=device), rtol=0, atol=1e-8)


@pytest.mark.parametrize("trace_axes", [(0,), (1, 3)], ids=["batch-axis", "two-axes"])
def test_ntk_eigenpairs_with_other_traced_axes(trace_axes):
    case = cnn()
    x = inputs(case, 3)
    kernel = reference_ntk(case.module, x, None, trace_axes=trace_axes)
    expected = torch.linalg.eigvalsh(as_matrix(kernel)).flip(0)[:3]
    pairs = torchntk.ntk_eigenpairs(case.module, x, 3, trace_axes=trace_axes)
    assert pairs.eigenvectors.shape == (*kernel.shape[0::2], 3)
    torch.testing.assert_close(pairs.eigenvalues, expected, rtol=1e-9, atol=1e-9 * float(expected[0]))


def test_ntk_eigenpairs_of_a_float32_model_agree_with_the_float64_reference():
    case = mlp()
    x = inputs(case, 40)
    expected = torch.linalg.eigvalsh(reference_ntk(case.module, x)).flip(0)[:4]
    pairs = torchntk.ntk_eigenpairs(case.module.float(), x.float(), 4)
    assert pairs.eigenvalues.dtype == torch.float32 and pairs.converged
    torch.testing.assert_close(pairs.eigenvalues.double(), expected, rtol=1e-4, atol=1e-5 * float(expected[0]))


def test_ntk_eigenpairs_are_reproducible_and_independent_of_block_size_and_chunks():
    case = mlp()
    x = inputs(case, 30)
    first = torchntk.ntk_eigenpairs(case.module, x, 3, seed=3)
    again = torchntk.ntk_eigenpairs(case.module, x, 3, seed=3, chunk_size=1)
    torch.testing.assert_close(again.eigenvectors, first.eigenvectors, rtol=0, atol=1e-12)
    other = torchntk.ntk_eigenpairs(case.module, x, 3, seed=4, block_size=3)
    torch.testing.assert_close(other.eigenvalues, first.eigenvalues, rtol=1e-10, atol=0)
    # One sign convention (largest entry positive) whatever the start.
    torch.testing.assert_close(other.eigenvectors, first.eigenvectors, rtol=0, atol=1e-7)


def test_ntk_eigenpairs_with_params_output_fn_and_kwargs():
    def f(params, x, scale):
        return {"out": scale * torch.tanh(x @ params["w"]) @ params["v"]}

    generator = torch.Generator().manual_seed(2)
    params = to_device({"w": torch.randn(3, 8, generator=generator, dtype=torch.float64),
                        "v": torch.randn(8, 2, generator=generator, dtype=torch.float64)})
    x = to_device(torch.randn(25, 3, generator=generator, dtype=torch.float64))
    kernel = reference_ntk(lambda p, x: f(p, x, 0.5)["out"], x, params=params, trace_axes=())
    expected = torch.linalg.eigvalsh(as_matrix(kernel)).flip(0)[:3]
    pairs = torchntk.ntk_eigenpairs(f, x, 3, params, trace_axes=(), output_fn=lambda out: out["out"], scale=0.5)
    torch.testing.assert_close(pairs.eigenvalues, expected, rtol=1e-9, atol=0)


# -- Lanczos on hand-built operators -------------------------------------------------------------


@pytest.mark.parametrize("tail", [[1.0 / (i + 1) for i in range(57)], [0.0] * 57], ids=["decaying", "rank-3"])
@pytest.mark.parametrize("k", [2, 3])
def test_top_eigenpairs_finds_a_double_eigenvalue_with_the_default_blocks_of_two(k, tail, device):
    # A single start vector converges to [9, 4] here (its Krylov space meets the 9-eigenspace once).
    matrix = rotated([9.0, 9.0, 4.0] + tail)
    pairs = torchntk.top_eigenpairs(lambda v: matrix @ v, 60, k, dtype=torch.float64, device=device)
    expected = torch.tensor([9.0, 9.0, 4.0][:k], dtype=torch.float64, device=device)
    torch.testing.assert_close(pairs.eigenvalues, expected)
    identity = torch.eye(k, dtype=torch.float64, device=device)
    torch.testing.assert_close(pairs.eigenvectors.T @ pairs.eigenvectors, identity)
    torch.testing.assert_close(matrix @ pairs.eigenvectors, pairs.eigenvectors * pairs.eigenvalues, atol=1e-7, rtol=0)


def test_top_eigenpairs_of_a_low_rank_operator_include_its_zero_eigenvalues(device):
    # Rank 2: the Krylov space is invariant after two blocks; fresh directions fill the rest.
    matrix = rotated([5.0, 2.0] + [0.0] * 38)
    pairs = torchntk.top_eigenpairs(lambda v: matrix @ v, 40, 4, dtype=torch.float64, device=device)
    assert pairs.converged
    expected = torch.tensor([5.0, 2.0, 0.0, 0.0], dtype=torch.float64, device=device)
    torch.testing.assert_close(pairs.eigenvalues, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(matrix @ pairs.eigenvectors, pairs.eigenvectors * pairs.eigenvalues, atol=1e-10, rtol=0)


def test_top_eigenpairs_on_tensor_shaped_vectors_and_when_the_subspace_spans_everything(device):
    matrix = rotated([float(i) for i in range(1, 13)])

    def matvec(v):  # v: (3, 4)
        return (matrix @ v.reshape(12)).reshape(3, 4)

    pairs = torchntk.top_eigenpairs(matvec, (3, 4), 12, dtype=torch.float64, device=device)
    assert pairs.converged and pairs.products == 12 and pairs.eigenvectors.shape == (3, 4, 12)
    torch.testing.assert_close(pairs.eigenvalues, torch.arange(12.0, 0.0, -1.0, dtype=torch.float64, device=device))


def test_top_eigenpairs_warns_when_not_converged(device):
    matrix = rotated([1.0 - 0.001 * i for i in range(200)])  # clustered: slow convergence
    with pytest.warns(RuntimeWarning, match=r"top_eigenpairs: not converged after 10 products"):
        pairs = torchntk.top_eigenpairs(lambda v: matrix @ v, 200, 2, dtype=torch.float64, device=device,
                                        max_products=10)
    assert not pairs.converged and pairs.products == 10


def test_a_non_symmetric_operator_is_an_error(device):
    matrix = rotated([float(i) for i in range(20)])
    matrix[0, 1] += 1.0
    with pytest.raises(ValueError, match=r"top_eigenpairs: the operator is not symmetric: \|u . A w - w . A u\|"):
        torchntk.top_eigenpairs(lambda v: matrix @ v, 20, 2, dtype=torch.float64, device=device)


def test_random_models_are_an_error_not_a_spectrum(device):
    model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 2)).to(device)
    with pytest.raises(ValueError, match=r"ntk_eigenpairs: Dropout at '1' draws random numbers in training mode"):
        torchntk.ntk_eigenpairs(model, to_device(torch.randn(10, 3)), 2)

    def noisy(params, x):  # a function: nothing to inspect, the products themselves disagree
        return x @ params * torch.rand(1, device=x.device)

    params = to_device(torch.randn(3, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"ntk_eigenpairs: the operator is not symmetric"):
        torchntk.ntk_eigenpairs(noisy, to_device(torch.randn(10, 3, dtype=torch.float64)), 2, params)


# -- Hutchinson ----------------------------------------------------------------------------------


def test_trace_estimate_is_unbiased_with_the_stated_standard_error(device):
    matrix = rotated([float(i % 7) for i in range(30)], seed=1)
    options = dict(probes=2000, dtype=torch.float64, device=device)
    estimate = torchntk.trace_estimate(lambda v: matrix @ v, 30, seed=5, **options)
    exact = float(torch.trace(matrix))
    assert abs(estimate.estimate - exact) < 4 * estimate.standard_error
    # Rademacher probes: Var[z.Az] = 2 (||A||_F^2 - sum A_ii^2).
    variance = 2 * (float((matrix**2).sum()) - float((torch.diagonal(matrix) ** 2).sum()))
    assert estimate.standard_error == pytest.approx((variance / 2000) ** 0.5, rel=0.1)
    assert estimate.probes == 2000 and estimate.samples.dtype == torch.float64


def test_trace_estimate_is_reproducible_per_seed(device):
    matrix = rotated([float(i) for i in range(10)])
    options = dict(probes=20, dtype=torch.float64, device=device)
    first = torchntk.trace_estimate(lambda v: matrix @ v, 10, seed=7, **options)
    again = torchntk.trace_estimate(lambda v: matrix @ v, 10, seed=7, **options)
    other = torchntk.trace_estimate(lambda v: matrix @ v, 10, seed=8, **options)
    assert torch.equal(first.samples, again.samples) and not torch.equal(first.samples, other.samples)


@pytest.mark.parametrize("trace_axes", [(-1,), ()], ids=["traced", "full"])
def test_ntk_trace_estimate_against_the_exact_trace(trace_axes):
    case = mlp()
    x = inputs(case, 12)
    kernel = reference_ntk(case.module, x, None, trace_axes=trace_axes)
    full = as_matrix(reference_ntk(case.module, x, None, trace_axes=()))
    estimate = torchntk.ntk_trace_estimate(case.module, x, probes=300, trace_axes=trace_axes, seed=2, chunk_size=64)
    assert abs(estimate.estimate - float(torch.trace(as_matrix(kernel)))) < 4 * estimate.standard_error
    # Each sample is z . K z / |T| for probe z: the i-th draw of a generator seeded with the seed.
    generator = torch.Generator().manual_seed(2)
    draws = [torch.randint(0, 2, (12, 4), generator=generator, dtype=torch.int8) for _ in range(300)]
    probes = 2 * torch.stack(draws) - 1
    probes = probes.double().reshape(300, 48)
    traced = 4 if trace_axes else 1
    expected = ((probes @ full.cpu()) * probes).sum(1) / traced  # the samples come back on the CPU
    torch.testing.assert_close(estimate.samples, expected, rtol=1e-10, atol=1e-10 * float(expected.abs().max()))
    again = torchntk.ntk_trace_estimate(case.module, x, probes=300, trace_axes=trace_axes, seed=2, chunk_size=7)
    torch.testing.assert_close(again.samples, estimate.samples, rtol=1e-12, atol=0)


# -- diagnostics against closed forms -------------------------------------------------------------


def test_condition_number():
    assert torchntk.condition_number(rotated([4.0, 2.0, 0.5])) == pytest.approx(8.0, rel=1e-12)
    assert torchntk.condition_number(rotated([3.0, -1.5])) == pytest.approx(2.0, rel=1e-12)  # |lambda|, as cond
    assert torchntk.condition_number(to_device(torch.diag(torch.tensor([1.0, 0.0])))) == math.inf
    # (N, N, O, O) read as the (N O, N O) matrix, rows (n, o).
    matrix = rotated([float(i + 1) for i in range(6)])
    kernel = matrix.reshape(3, 2, 3, 2).permute(0, 2, 1, 3)
    assert torchntk.condition_number(kernel) == pytest.approx(6.0, rel=1e-12)


def test_effective_rank_against_its_definitions():
    eigenvalues = [5.0, 3.0, 1.0, 0.5, 0.0]
    kernel = rotated(eigenvalues)
    weights = torch.tensor(eigenvalues, dtype=torch.float64) / sum(eigenvalues)
    entropy = -sum(float(w * torch.log(w)) for w in weights if w > 0)
    participation = sum(eigenvalues) ** 2 / sum(e * e for e in eigenvalues)
    assert torchntk.effective_rank(kernel) == pytest.approx(participation, rel=1e-12)
    assert torchntk.effective_rank(kernel, kind="entropy") == pytest.approx(math.exp(entropy), rel=1e-12)
    for kind in ("participation", "entropy"):
        assert torchntk.effective_rank(rotated([2.0] * 3 + [0.0] * 3), kind=kind) == pytest.approx(3.0, rel=1e-12)
        assert torchntk.effective_rank(to_device(torch.zeros(3, 3)), kind=kind) == 0.0


def test_kernel_target_alignment_closed_forms():
    labels = to_device(torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64))
    kernel = torch.outer(labels, labels) + to_device(torch.eye(4, dtype=torch.float64))
    # <K, yy^T> = 16 + 4, ||yy^T|| = 4; ||K||^2 = 16 + 8 + 4, centered ||HKH||^2 = 16 + 8 + 3.
    assert torchntk.kernel_target_alignment(kernel, labels, centered=False) == pytest.approx(20 / (4 * 28**0.5))
    assert torchntk.kernel_target_alignment(kernel, labels) == pytest.approx(20 / (4 * 27**0.5))
    # The all-ones kernel: uncentered alignment 1 with constant targets; centered, one-hot labels
    # and a class-indicator kernel are perfectly aligned.
    ones, ones_targets = to_device((torch.ones(3, 3), torch.ones(3)))
    assert torchntk.kernel_target_alignment(ones, ones_targets, centered=False) == pytest.approx(1.0)
    one_hot = to_device(torch.eye(3).repeat_interleave(2, dim=0))  # (6, 3)
    assert torchntk.kernel_target_alignment(one_hot @ one_hot.T, one_hot) == pytest.approx(1.0)


def test_kernel_target_alignment_on_a_full_kernel_against_the_explicit_formula():
    generator = torch.Generator().manual_seed(3)
    features = to_device(torch.randn(8, 5, generator=generator, dtype=torch.float64))
    matrix = features @ features.T                                   # (N O, N O), N = 4, O = 2
    kernel = matrix.reshape(4, 2, 4, 2).permute(0, 2, 1, 3)          # (N, N, O, O)
    targets = to_device(torch.randn(4, 2, generator=generator, dtype=torch.float64))
    y = targets.reshape(8, 1)
    center = to_device(torch.eye(8, dtype=torch.float64) - 1 / 8)
    for centered, k, g in ((False, matrix, y @ y.T), (True, center @ matrix @ center, center @ y @ y.T @ center)):
        expected = float((k * g).sum() / (k.norm() * g.norm()))
        alignment = torchntk.kernel_target_alignment(kernel, targets, centered=centered)
        assert alignment == pytest.approx(expected, rel=1e-12)


def test_relative_change():
    a = to_device(torch.tensor([[2.0, 1.0], [1.0, 2.0]]))
    b = a + to_device(torch.tensor([[0.0, 1.0], [1.0, 0.0]]))
    assert torchntk.relative_change(a, b) == pytest.approx(2**0.5 / 10**0.5)
    assert torchntk.relative_change(a, a) == 0.0
    trees = to_device(({"x": a, "y": torch.ones(3)}, {"x": b, "y": torch.ones(3)}))
    assert torchntk.relative_change(*trees) == pytest.approx(2**0.5 / 13**0.5)


def test_diagnostics_of_an_ntk_from_the_library():
    case = mlp()
    x = inputs(case, 10)
    kernel = torchntk.empirical_ntk_fn(case.module)(x)
    reference = reference_ntk(case.module, x)
    eigenvalues = torch.linalg.eigvalsh(reference)
    assert torchntk.condition_number(kernel) == pytest.approx(float(eigenvalues.max() / eigenvalues.min()), rel=1e-6)
    assert torchntk.relative_change(reference, kernel) < 1e-12


# -- errors ----------------------------------------------------------------------------------------


def test_kernel_errors():
    with pytest.raises(TypeError, match=r"condition_number: `kernel` must be a floating-point tensor, got \[\[1"):
        torchntk.condition_number([[1.0]])
    with pytest.raises(ValueError, match=r"`kernel` must have axes in \(x1, x2\) pairs.*got shape \(3, 3, 2\)"):
        torchntk.effective_rank(to_device(torch.ones(3, 3, 2)))
    with pytest.raises(ValueError, match=r"not square: its x1 axes \(3,\) differ from its x2 axes \(2,\)"):
        torchntk.condition_number(to_device(torch.ones(3, 2)))
    with pytest.raises(ValueError, match=r"`kernel` is not symmetric"):
        torchntk.condition_number(to_device(torch.tensor([[1.0, 2.0], [0.0, 1.0]])))
    with pytest.raises(ValueError, match=r"`kernel` holds 1 NaN or infinite entry"):
        torchntk.effective_rank(to_device(torch.tensor([[1.0, float("nan")], [float("nan"), 1.0]]).tril()))
    with pytest.raises(ValueError, match=r"has no entries"):
        torchntk.condition_number(to_device(torch.ones(0, 0)))
    with pytest.raises(ValueError, match=r"`kind` must be one of \('participation', 'entropy'\), got 'trace'"):
        torchntk.effective_rank(to_device(torch.eye(2)), kind="trace")
    with pytest.raises(ValueError, match=r"not positive semi-definite: its smallest eigenvalue is -1.000e\+00"):
        torchntk.effective_rank(to_device(torch.diag(torch.tensor([2.0, -1.0]))), kind="entropy")


def test_alignment_and_change_errors():
    with pytest.raises(ValueError, match=r"`targets` of shape \(3,\) must start with the kernel's coordinate shape"):
        torchntk.kernel_target_alignment(to_device(torch.eye(4)), to_device(torch.ones(3)))
    with pytest.raises(TypeError, match=r"`targets` must be a floating-point tensor"):
        torchntk.kernel_target_alignment(to_device(torch.eye(4)), to_device(torch.ones(4, dtype=torch.int64)))
    with pytest.raises(TypeError, match=r"`centered` must be a bool, got 1"):
        torchntk.kernel_target_alignment(to_device(torch.eye(2)), to_device(torch.ones(2)), centered=1)
    with pytest.raises(ValueError, match=r"the kernel is zero after centering"):
        torchntk.kernel_target_alignment(to_device(torch.ones(3, 3)), to_device(torch.tensor([1.0, 2.0, 3.0])))
    with pytest.raises(ValueError, match=r"targets' Gram matrix is zero after centering"):
        torchntk.kernel_target_alignment(to_device(torch.eye(3)), to_device(torch.ones(3)))
    with pytest.raises(ValueError, match=r"`kernel_a` has shape \(2, 2\) but `kernel_b` has \(3, 3\)"):
        torchntk.relative_change(to_device(torch.eye(2)), to_device(torch.eye(3)))
    with pytest.raises(ValueError, match=r"`kernel_a` is all zero"):
        torchntk.relative_change(to_device(torch.zeros(2)), to_device(torch.ones(2)))
    with pytest.raises(ValueError, match=r"must have the same structure"):
        torchntk.relative_change({"a": to_device(torch.eye(2))}, {"b": to_device(torch.eye(2))})
    with pytest.raises(TypeError, match=r"`kernel_b\[1\]` must be a floating-point tensor, got 'x'"):
        torchntk.relative_change([to_device(torch.eye(2)), to_device(torch.eye(2))], [to_device(torch.eye(2)), "x"])


def test_eigenpairs_and_trace_argument_errors(device):
    case = mlp()
    x = inputs(case, 5)

    def matvec(v):
        return v

    with pytest.raises(ValueError, match=r"ntk_eigenpairs: `k`=6 exceeds the number of kernel coordinates 5 \(shape"):
        torchntk.ntk_eigenpairs(case.module, x, 6)
    with pytest.raises(ValueError, match=r"`k` must be a positive int, got 0"):
        torchntk.ntk_eigenpairs(case.module, x, 0)
    with pytest.raises(TypeError, match=r"`k` must be a positive int, got 2.0"):
        torchntk.top_eigenpairs(matvec, 4, 2.0)
    with pytest.raises(ValueError, match=r"`max_products`=2 is below `k`=3"):
        torchntk.top_eigenpairs(matvec, 4, 3, max_products=2)
    with pytest.raises(ValueError, match=r"`block_size` must be a positive int, got 0"):
        torchntk.top_eigenpairs(matvec, 4, 1, block_size=0)
    with pytest.raises(ValueError, match=r"`tol` must be positive, got -1.0"):
        torchntk.top_eigenpairs(matvec, 4, 1, tol=-1.0)
    with pytest.raises(ValueError, match=r"`trace_axes`=\(2,\) has axis 2, out of range"):
        torchntk.ntk_eigenpairs(case.module, x, 1, trace_axes=2)
    with pytest.raises(ValueError, match=r"`chunk_size` must be None or a positive int, got 0"):
        torchntk.ntk_trace_estimate(case.module, x, chunk_size=0)
    with pytest.raises(TypeError, match=r"model's output must be one floating-point tensor, got \('Tensor\(5, 4\)', "):
        torchntk.ntk_eigenpairs(case.module, x, 1, output_fn=lambda out: (out, out))
    with pytest.raises(ValueError, match=r"ntk_trace_estimate: `probes` must be at least 2"):
        torchntk.ntk_trace_estimate(case.module, x, probes=1)
    with pytest.raises(TypeError, match=r"trace_estimate: `shape` must be an int or a sequence of ints, got 'a'"):
        torchntk.trace_estimate(matvec, "a")
    with pytest.raises(ValueError, match=r"`shape` must be non-empty with positive sizes, got \(0,\)"):
        torchntk.trace_estimate(matvec, 0)
    with pytest.raises(TypeError, match=r"`matvec` must be a callable v -> A v"):
        torchntk.top_eigenpairs(None, 4, 1)
    with pytest.raises(TypeError, match=r"`dtype` must be None or a floating-point torch.dtype, got torch.int64"):
        torchntk.top_eigenpairs(matvec, 4, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"`matvec` must return a tensor of shape \(4,\), like its argument, got \(2"):
        torchntk.trace_estimate(lambda v: v[:2], 4, device=device)
    with pytest.raises(ValueError, match=r"top_eigenpairs: the operator returned NaN or infinite entries"):
        torchntk.top_eigenpairs(lambda v: v * float("nan"), 4, 1, device=device)
