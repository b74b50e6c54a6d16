"""Benchmark scripts that only a GPU session runs in earnest still run: on the CPU, tiny sizes."""

from __future__ import annotations

import pathlib
import re

import pytest

from tests import zoo
from tests._processes import run_python

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.cpu_only("runs a benchmark script in a child process, on the CPU by its own --device")
def test_the_cuda_benchmark_runs_on_the_cpu(tmp_path):
    done = run_python(
        str(ROOT / "benchmarks" / "bench_cuda.py"), "--device", "cpu", "--n", "24", "--warmup-n", "4",
        "--batch-size", "8", "--profile-n", "1", "--profile-calls", "1", "--profile-rows", "5", timeout=600,
        env={"OUT": str(tmp_path)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "| 24 | (24, 24) cpu |" in out and "| True |" in out
    assert "aten::" in out and "Self CPU" in out
    # the large kernel first, each part written to $OUT when done: the shared GPU check's time limit
    # may stop the script during the profile
    assert out.index("| 24 | (24, 24) cpu |") < out.index("Self CPU")
    assert (tmp_path / "bench_cuda.md").read_text().strip() == out.strip()


@pytest.mark.slow
@pytest.mark.cpu_only("runs a benchmark script in a child process, on the CPU by its own --device")
def test_the_cuda_benchmarks_other_parts_run_on_the_cpu_and_write_their_report(tmp_path):
    done = run_python(
        str(ROOT / "benchmarks" / "bench_cuda.py"), "--device", "cpu", "--parts", "compile,memory,auto",
        "--memory-grid", "fast", "--compile-models", "mlp", timeout=600, env={"OUT": str(tmp_path / "out")},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = (tmp_path / "out" / "bench_cuda.md").read_text()
    assert report.strip() == done.stdout.strip()  # every part in the report, as printed
    _, captured, measured, picked = re.split(r"^## ", report, flags=re.MULTILINE)
    assert captured.startswith("Captured kernels") and measured.startswith("Memory plans") and picked.startswith("AUTO")

    def rows(section: str) -> list[list[str]]:
        lines = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| model")]
        return [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines]

    (compiled,) = rows(captured)
    assert compiled[:3] == ["mlp", "2", "traced"] and compiled[7] == "True" and float(compiled[8]) < 1e-4, compiled
    memory_rows = rows(measured)
    assert len(memory_rows) == 15 and all(row[-1] == "yes" for row in memory_rows), measured
    picks = rows(picked)
    assert [row[0] for row in picks] == ["mlp", "cnn"] and all(float(row[-1]) >= 1.0 for row in picks), picked


@pytest.mark.slow
@pytest.mark.cpu_only("runs a benchmark script in a child process, on the CPU")
def test_the_workload_benchmark_runs_and_every_method_agrees_with_the_hand_written_loop():
    zoo.import_peft()  # the script's models: skipped, saying why, where they do not import
    done = run_python(
        str(ROOT / "benchmarks" / "bench_workloads.py"), "--layers", "1", "--hidden", "32", "--vocab", "100",
        "--n", "3", "--dtypes", "float32", "--repeats", "1", "--methods", "hand,1,2,3,0,1f,3f,floor", "--extrapolate", "6",
        "--block", "2", "--extrapolate-full",
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    rows = [line.split("|") for line in lines if line.startswith(("| roberta", "| gpt2")) and "batch(" not in line]
    assert len(rows) == 2 * 4 * 8  # models x parameter sets x methods
    kernels = [row for row in rows if row[6].strip() != "floor"]
    assert all(float(row[-2]) < 1e-3 for row in kernels), done.stdout  # relative difference from the hand-written kernel
    assert all(row[-2].strip() == "-" and float(row[9]) == 1.0 for row in rows if row[6].strip() == "floor"), done.stdout
    assert all(float(row[9]) > 0 and float(row[10]) > 0 for row in rows), done.stdout  # method / floor, CPU / wall
    extrapolations = [line for line in lines if "batch(batch_size=2, out=<memmap>" in line]
    assert len(extrapolations) == 2 * 4 and all("N = 6:" in line for line in extrapolations), done.stdout
    assert all(re.search(r"min\), measured \d+ s .*batch_size=.auto.: \d+ s", line) for line in extrapolations), done.stdout


@pytest.mark.slow
@pytest.mark.cpu_only("runs a benchmark script in a child process, on the CPU")
def test_the_diffop_benchmark_runs_and_every_method_agrees_with_the_hand_written_loop():
    done = run_python(
        str(ROOT / "benchmarks" / "bench_diffop.py"), "--quick", "--loop", "--dtypes", "float32,float64", timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [
        [cell.strip() for cell in line.split("|")[1:-1]]
        for line in done.stdout.splitlines() if line.startswith(("| poisson", "| forces"))
    ]
    # per dtype: the Poisson vectorised hand loop (the peer) and its Python loop, each style's 4
    # implementations and floor; the force field's peer, loop, 4 implementations and floor
    assert len(rows) == 2 * (2 + 2 * 5 + 7), done.stdout
    compared = [row for row in rows if row[1] in ("hand", "1", "2", "3", "0")]
    assert len(compared) == 2 * (1 + 2 * 4 + 1 + 4)
    assert all(float(row[4]) < 1e-4 for row in compared), done.stdout  # relative difference from the peer
    assert all("picks" in row[5] and "planned" in row[5] for row in compared if row[1] == "0"), done.stdout
    assert done.stdout.count("x the vectorised hand loop; AUTO") == 2 * 3, done.stdout


@pytest.mark.slow
@pytest.mark.cpu_only("runs a benchmark script in a child process, on the CPU")
def test_the_training_mode_benchmark_plans_runs_of_logits_within_its_budget():
    done = run_python(str(ROOT / "benchmarks" / "bench_training_mode.py"), "--n", "2", "--classes", "12",
                      "--memory", "600MB", "--implementation", "1", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "implementation 1, `vmap_axes` None (BatchNorm2d at 'bn1' couples" in done.stdout, done.stdout
    assert re.search(r"MemoryPlanWarning: .* computing it with chunk_size=\d+ \(output entries", done.stdout), done.stdout
    assert "training mode" in done.stdout, done.stdout


@pytest.mark.slow
@pytest.mark.cpu_only("runs a benchmark script in child processes, on the CPU")
def test_the_floor_of_the_rows_against_neural_tangents_is_the_kernel_written_by_hand():
    done = run_python(
        str(ROOT / "benchmarks" / "bench_structured.py"), "--versus-nt", "--floor", "--no-nt", "--models", "mlp,cnn",
        "--sizes", "4", "--kernels", "traced,full", "--rounds", "1", "--repeats", "1", "--jax-layouts", "in-out",
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith(("mlp ", "cnn "))]
    assert len(rows) == 4, done.stdout
    for row in rows:
        assert float(row[-4]) > 0 and float(row[-3]) > 0, done.stdout  # floor [ms], torchntk / floor
        assert float(row[-1]) < 1e-5, done.stdout  # the floor forms the whole kernel: it agrees with torchntk's
    # the machine's matrix products, which the floors are made of, timed in torch's own worker
    gemm = [line for line in done.stdout.splitlines() if line.startswith("GEMM    :")]
    assert len(gemm) == 1 and float(gemm[0].split("torch ")[1].split(" GFLOP/s")[0]) > 0, done.stdout
