"""Predicted vs actual training curves of a wide network, from its NTK at initialisation.

Trains a one-hidden-layer tanh network (NTK parameterisation) on a small regression problem with
plain full-batch gradient descent, and draws its training and test losses, and a few test
outputs, next to what ``torchntk.predict.gradient_descent_mse`` predicts from the empirical NTK
at initialisation. The wider the network, the closer the curves. Writes a PNG.

    python examples/predict_training_curves.py --widths 64,4096 --output predict_curves.png
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn

import torchntk
from torchntk import predict


class NtkLinear(nn.Module):
    """``W x / sqrt(fan_in) + 0.1 b`` with ``W``, ``b`` ~ N(0, 1): the NTK converges as width grows."""

    def __init__(self, fan_in: int, fan_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(fan_out, fan_in, dtype=torch.float64))
        self.bias = nn.Parameter(torch.randn(fan_out, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T / math.sqrt(self.weight.shape[1]) + 0.1 * self.bias


def make_model(width: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(NtkLinear(1, width), nn.Tanh(), NtkLinear(width, 1))


def data() -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(1)
    x_train = torch.linspace(-2, 2, 16, dtype=torch.float64)[:, None]
    y_train = torch.sin(2 * x_train) + 0.1 * torch.randn(16, 1, generator=generator, dtype=torch.float64)
    x_test = torch.linspace(-2.5, 2.5, 64, dtype=torch.float64)[:, None]
    return x_train, y_train, x_test, torch.sin(2 * x_test)


def run(width: int, steps: int, lr_fraction: float) -> dict:
    x_train, y_train, x_test, y_test = data()
    model = make_model(width)
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0)
    k_train, k_test = ntk_fn(x_train), ntk_fn(x_test, x_train)
    learning_rate = lr_fraction * predict.max_learning_rate(k_train)
    with torch.no_grad():
        f_train, f_test = model(x_train), model(x_test)
    times = torch.unique(torch.logspace(0, math.log10(steps), 30, dtype=torch.float64).round())
    predicted_train, predicted_test = predict.gradient_descent_mse(k_train, y_train, learning_rate, trace_axes=())(
        times, f_train, f_test, k_test
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate)
    actual_train, actual_test = [], []
    wanted = set(int(t) for t in times)
    for step in range(steps + 1):
        if step in wanted:
            with torch.no_grad():
                actual_train.append(model(x_train))
                actual_test.append(model(x_test))
        optimizer.zero_grad()
        loss = ((model(x_train) - y_train) ** 2).sum() / (2 * y_train.numel())
        loss.backward()
        optimizer.step()

    def mse(outputs, targets):
        return ((outputs - targets) ** 2).mean(dim=(-2, -1))

    return dict(
        width=width, times=times, x_test=x_test,
        predicted=(mse(predicted_train, y_train), mse(predicted_test, y_test), predicted_test[-1]),
        actual=(mse(torch.stack(actual_train), y_train), mse(torch.stack(actual_test), y_test), actual_test[-1]),
    )


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for index, result in enumerate(results):
        color = f"C{index}"
        for side, (ax, name) in enumerate(zip(axes[:2], ("training loss", "test loss"))):
            ax.loglog(result["times"], result["actual"][side], color=color, label=f"width {result['width']}: trained")
            ax.loglog(result["times"], result["predicted"][side], color=color, linestyle="--", label=f"width {result['width']}: predicted")
            ax.set_title(name)
            ax.set_xlabel("gradient descent step")
        axes[2].plot(result["x_test"][:, 0], result["actual"][2][:, 0], color=color, label=f"width {result['width']}: trained")
        axes[2].plot(result["x_test"][:, 0], result["predicted"][2][:, 0], color=color, linestyle="--",
                     label=f"width {result['width']}: predicted")
    x_train, y_train, x_test, y_test = data()
    axes[2].scatter(x_train[:, 0], y_train[:, 0], color="black", s=12, label="training points")
    axes[2].set_title("test outputs after training")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="64,4096", help="comma-separated hidden widths (default 64,4096)")
    parser.add_argument("--steps", type=int, default=2000, help="gradient descent steps (default 2000)")
    parser.add_argument("--lr-fraction", type=float, default=0.1, help="learning rate as a fraction of max_learning_rate")
    parser.add_argument("--output", default="predict_curves.png", help="the PNG to write")
    arguments = parser.parse_args(argv)
    results = [run(int(width), arguments.steps, arguments.lr_fraction) for width in arguments.widths.split(",")]
    for result in results:
        gap = (result["predicted"][1] - result["actual"][1]).abs().max().item()
        print(f"width {result['width']}: final test loss trained {result['actual'][1][-1].item():.4f}, "
              f"predicted {result['predicted'][1][-1].item():.4f}; largest gap over time {gap:.2e}")
    plot(results, arguments.output)
    print(f"figure: {arguments.output}")


if __name__ == "__main__":
    main()
