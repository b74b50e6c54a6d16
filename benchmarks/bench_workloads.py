#!/usr/bin/env python
"""The workload users run most: NTKs of a base-size transformer over LoRA, BitFit, head or all
parameters, against the ``torch.func.jacrev`` loop users write by hand, timed in the same run.

Models are built from configs with random weights (no download): a RoBERTa-base-size masked LM
(12 layers, hidden 768, vocab 8000 by default; the kernel of 2 label-word logits at the mask
position) and a GPT-2-small-size causal LM (the kernel of 2 logits at the last non-pad token); 32
tokens with right padding, the mask (or last token) at varying positions; x2 = None, full layout
(``trace_axes=()``). Parameter sets: ``lora`` (peft, r = 8 on the attention's query and value, or
``c_attn`` for GPT-2), ``bitfit`` (biases), ``head`` (the LM head's dense layer or GPT-2's last
block's MLP), ``all``. Methods: ``hand`` (per example, ``jacrev`` of ``functional_call`` over the
set, stacked, one einsum; skipped, with the memory it would need, where its Jacobians do not
fit), torchntk's implementations ``1``, ``2``, ``3`` and ``0`` (AUTO, its pick reported), each
with the default ``check_vmap_axes=True`` or, suffixed ``f``, ``check_vmap_axes="first"``, and
``floor``: the batch's forward pass and one backward sweep per logit to the set, summed over the
examples (:func:`floor`), the arithmetic every method makes at least, against which each method's
time is given as a ratio. Each kernel is checked against the first method's and timed as the
median of ``--repeats`` warm calls, with the CPU time it took over its wall time (the cores it
keeps busy), and the seconds of its first call (its plan and checks; the first method of a
process also pays PyTorch's lazy initialisation); peak memory is the process' resident-set growth
during the method's first call (Linux), reported when one method runs per process (``--methods``). The methods' warm calls alternate, round by round.
``--extrapolate N`` times the kernel of N examples written by ``batch`` into a memmap with a
progress file on 1, 2 and 3 blocks and extrapolates.

    python benchmarks/bench_workloads.py     # the whole grid, N = 512 extrapolated: hours on 2 cores
    python benchmarks/bench_workloads.py --models roberta --sets lora --n 16 --dtypes float32 --extrapolate 0
    python benchmarks/bench_workloads.py --models roberta --sets lora --n "" --dtypes float32
    python benchmarks/bench_workloads.py --layers 2 --hidden 64 --vocab 500 --n 4   # a quick check
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import resource
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.func import functional_call, jacrev  # noqa: E402

import torchntk  # noqa: E402
from tests import zoo  # noqa: E402

TOKENS = 32
LABELS = (5, 7)  # the label words' token ids


def build(name: str, layers: int, hidden: int, vocab: int):
    """``(model, head parameter prefix)`` for ``name`` in eval mode, random weights."""
    transformers = zoo.import_transformers()
    heads = max(1, hidden // 64)
    if name == "roberta":
        config = transformers.RobertaConfig(
            vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
            intermediate_size=4 * hidden, max_position_embeddings=TOKENS + 2, pad_token_id=1,
        )
        return transformers.RobertaForMaskedLM(config).eval(), "lm_head.dense."
    config = transformers.GPT2Config(
        vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=TOKENS, bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config).eval(), f"transformer.h.{layers - 1}.mlp."


def inputs(name: str, n: int, vocab: int, seed: int = 0):
    """Token ids, the right-padded attention mask and the position the logits are read at."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, TOKENS), generator=generator)
    lengths = torch.randint(TOKENS // 2, TOKENS + 1, (n,), generator=generator)
    mask = (torch.arange(TOKENS)[None] < lengths[:, None]).long()
    if name == "roberta":  # a mask token somewhere in each sequence
        where = (torch.rand(n, generator=generator) * (lengths - 1)).long()
        ids[torch.arange(n), where] = 4
    else:
        where = lengths - 1
    return ids, mask, where


def label_logits(output, input_ids, attention_mask, where):
    """The label words' logits at each sequence's position ``where``: ``(N, 2)``."""
    logits = output.logits
    rows = torch.arange(input_ids.shape[0], device=logits.device)
    return logits[rows, where][:, list(LABELS)]


def parameter_set(model, name: str, choice: str, head: str):
    """The model to differentiate (peft-wrapped for LoRA) with ``requires_grad`` on the set only."""
    if choice == "lora":
        peft = zoo.import_peft()
        targets = ["query", "value"] if name == "roberta" else ["c_attn"]
        config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets,
                                 init_lora_weights=False, fan_in_fan_out=name == "gpt2")
        return peft.get_peft_model(model, config).eval()
    for parameter_name, parameter in model.named_parameters():
        parameter.requires_grad_(
            choice == "all" or (choice == "bitfit" and parameter_name.endswith("bias"))
            or (choice == "head" and parameter_name.startswith(head))
        )
    return model


def hand_written(model, ids, mask, where):
    """What users write: per example, the Jacobian of the logits over the trainable parameters,
    stacked; then one contraction over the parameters."""
    trainable = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    frozen = {name: p.detach() for name, p in model.named_parameters() if not p.requires_grad}
    buffers = dict(model.named_buffers())

    def logits(params, i):
        output = functional_call(model, {**params, **frozen, **buffers}, (ids[i:i + 1],),
                                 {"attention_mask": mask[i:i + 1]})
        return label_logits(output, ids[i:i + 1], mask[i:i + 1], where[i:i + 1])[0]

    jacobians = [jacrev(logits)(trainable, i) for i in range(ids.shape[0])]
    flat = torch.stack([torch.cat([j.reshape(j.shape[0], -1) for j in jac.values()], 1) for jac in jacobians])
    return torch.einsum("nap,mbp->nmab", flat, flat)


def floor(model, ids, mask, where):
    """The arithmetic every method makes at least, without keeping the examples apart: one forward
    pass of the batch and one backward pass per label logit (summed over the examples) down to the
    trainable parameters, with their gradients. Any kernel needs these sweeps (the per-example
    Jacobians are made from them); its contraction over the parameters comes on top. Returns the
    gradients (no kernel)."""
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    logits = label_logits(model(input_ids=ids, attention_mask=mask), ids, mask, where)
    return [
        torch.autograd.grad(logits[:, label].sum(), trainable, retain_graph=label < len(LABELS) - 1)
        for label in range(len(LABELS))
    ]


def measure(calls: dict, repeats: int) -> tuple[dict, dict, dict, dict, dict]:
    """Each call warmed up once (plans, checks, caches), then ``repeats`` rounds timing every call
    in turn, so that a change of the machine's load falls on all of them alike. Returns the median
    seconds, the process CPU time over the wall time of the timed calls (the cores a method keeps
    busy; at most the threads torch is given, plus a little for other threads), the resident-set
    growth in MB of each call's warm-up (meaningful for the first call of a process only: the peak
    is the process'), the seconds of that first call (its plan and checks; the first method of a
    process also pays PyTorch's lazy initialisation), and the results."""
    grown, first, kernels = {}, {}, {}
    for method, call in calls.items():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.perf_counter()
        kernels[method] = call()
        first[method] = time.perf_counter() - start
        grown[method] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    times: dict = {method: [] for method in calls}
    cpu: dict = {method: [] for method in calls}
    for _ in range(repeats):
        for method, call in calls.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            call()
            times[method].append(time.perf_counter() - start)
            cpu[method].append(time.process_time() - start_cpu)
    medians = {method: statistics.median(values) for method, values in times.items()}
    busy = {method: sum(cpu[method]) / sum(times[method]) for method in calls}
    return medians, busy, grown, first, kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="roberta,gpt2", help="comma list of roberta, gpt2")
    parser.add_argument("--sets", default="lora,bitfit,head,all", help="comma list of lora, bitfit, head, all")
    parser.add_argument("--n", default="16,64", help="comma list of numbers of examples")
    parser.add_argument("--methods", default="hand,1,3,0,1f,3f,0f,floor",
                        help="comma list of hand, 1, 2, 3, 0 (AUTO), floor (the batch's forward pass and "
                             "backward sweeps alone); a suffix f: check_vmap_axes='first'")
    parser.add_argument("--dtypes", default="float32,float64", help="comma list of float32, float64")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--extrapolate", type=int, default=512,
                        help="N of a kernel written by batch into a memmap, timed on 1-3 blocks and extrapolated")
    parser.add_argument("--block", type=int, default=32, help="batch_size of --extrapolate")
    parser.add_argument("--extrapolate-full", action="store_true",
                        help="also compute the whole --extrapolate kernel (--block, then batch_size='auto'), "
                             "to check the extrapolation")
    parser.add_argument("--extrapolate-method", default="0f", help="method of --extrapolate (as in --methods)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)  # PyTorch's vmap performance notes
    print(f"torch {torch.__version__}, {args.threads} threads, {TOKENS} tokens, "
          f"{args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, median of {args.repeats}")
    print("| model | set | dtype | parameters | N | method | seconds | hand / method | method / floor | CPU / wall "
          "| first call s | RSS growth MB | rel. diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, choice, dtype_name in itertools.product(*(args.models.split(","), args.sets.split(","),
                                                         args.dtypes.split(","))):
        dtype = getattr(torch, dtype_name)
        torch.manual_seed(0)
        base, head = build(name, args.layers, args.hidden, args.vocab)
        model = parameter_set(base.to(dtype), name, choice, head)
        count = sum(p.numel() for p in model.parameters() if p.requires_grad)
        for n in (int(size) for size in args.n.split(",") if size):
            ids, mask, where = inputs(name, n, args.vocab)

            calls, labels, auto = {}, {}, {}
            for method in args.methods.split(","):
                if method == "hand":
                    # its stacked Jacobians and their concatenated copy, (N, O, P) each
                    needed = 2 * n * len(LABELS) * count * dtype.itemsize
                    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
                    if needed > 0.8 * available:
                        print(f"| {name} | {choice} | {dtype_name} | {count:,} | {n} | hand | needs "
                              f"{needed / 2**30:.1f} GiB of Jacobians, {available / 2**30:.1f} GiB available | | | | "
                              f"| | |", flush=True)
                        continue
                    calls[method] = lambda: hand_written(model, ids, mask, where)  # noqa: E731
                elif method == "floor":
                    calls[method] = lambda: floor(model, ids, mask, where)  # noqa: E731
                else:
                    ntk_fn = ntk_function(model, int(method[0]), "first" if method.endswith("f") else True)
                    calls[method] = lambda ntk_fn=ntk_fn: ntk_fn(ids, None, attention_mask=mask, rows=where)  # noqa: E731
                    if method.startswith("0"):
                        auto[method] = ntk_fn
            times, busy, grown, first, kernels = measure(calls, args.repeats)
            for method, ntk_fn in auto.items():  # asked after the first call, which it would otherwise plan
                chosen = ntk_fn.auto_choice(ids, None, attention_mask=mask, rows=where).implementation
                labels[method] = f"{method} (picks {int(chosen)})"
            reference = next((kernel for method, kernel in kernels.items() if method != "floor"), None)
            for method, seconds in times.items():
                difference = "-"
                if method != "floor" and reference is not None:
                    difference = f"{float((kernels[method] - reference).abs().max() / reference.abs().max()):.1e}"
                ratio = times["hand"] / seconds if "hand" in times else float("nan")
                above_floor = seconds / times["floor"] if "floor" in times else float("nan")
                memory = f"{grown[method]:.0f}" if len(calls) == 1 else "-"
                print(f"| {name} | {choice} | {dtype_name} | {count:,} | {n} | {labels.get(method, method)} | "
                      f"{seconds:.3f} | {ratio:.2f} | {above_floor:.2f} | {busy[method]:.2f} | {first[method]:.3f} | {memory} | "
                      f"{difference} |", flush=True)
        if args.extrapolate:
            extrapolated(model, name, args.vocab, args.extrapolate, args.block, args.extrapolate_method, dtype,
                         args.extrapolate_full)


def ntk_function(model, method: int, check=True):
    """torchntk's kernel function for the workload: the positions travel as a keyword argument,
    mapped with the examples, and the output selector reads them. ``check``: ``check_vmap_axes``."""
    def selected(output, input_ids, attention_mask, rows):
        return label_logits(output, input_ids, attention_mask, rows)

    return torchntk.empirical_ntk_fn(
        _Positions(model), trace_axes=(), implementation=method,
        vmap_axes=(0, 0, {"attention_mask": 0, "rows": 0}), output_fn=selected, check_vmap_axes=check,
    )


def extrapolated(model, name: str, vocab: int, total: int, block: int, method: str, dtype, full: bool = False) -> None:
    """The kernel of ``total`` examples written into a memmap by ``batch`` (with a progress file),
    timed on ``k = 1, 2`` blocks of ``block`` examples (the faster of two runs each) and
    extrapolated as ``T(k) = a k + b k (k + 1) / 2`` (each block's examples prepared once; the pairs ``i <= j`` of a symmetric kernel
    contracted), the model checked on ``k = 3`` before it predicts ``total``; ``full``: the kernel
    of all ``total`` examples is then computed and timed too, with ``block`` and with the default
    ``batch_size="auto"``."""
    import tempfile

    import numpy

    ids, mask, where = inputs(name, total, vocab)
    batched = torchntk.batch(ntk_function(model, int(method[0]), "first" if method.endswith("f") else True),
                             batch_size=block)
    numpy_dtype = numpy.float32 if dtype == torch.float32 else numpy.float64
    with tempfile.TemporaryDirectory() as folder:
        def run(k: int, tag: str) -> float:
            n = k * block
            out = numpy.lib.format.open_memmap(f"{folder}/{tag}.npy", mode="w+", dtype=numpy_dtype, shape=(n, n, 2, 2))
            start = time.perf_counter()
            batched(ids[:n], None, out=out, progress_file=f"{folder}/{tag}.json", attention_mask=mask[:n],
                    rows=where[:n])
            return time.perf_counter() - start

        run(1, "warm-up")  # plans and checks for the block's shapes
        one = min(run(1, "one"), run(1, "one again"))  # the faster of two: load only ever slows a run
        two = min(run(2, "two"), run(2, "two again"))
        pairs = two - 2 * one  # b
        per_block = one - pairs  # a
        predicted3, three = 3 * per_block + 6 * pairs, run(3, "three")
        blocks = math.ceil(total / block)
        predicted = blocks * per_block + blocks * (blocks + 1) / 2 * pairs
        measured = ""
        if full:
            whole = run(blocks, "full")
            automatic = torchntk.batch(ntk_function(model, int(method[0]), "first" if method.endswith("f") else True))
            out = numpy.lib.format.open_memmap(f"{folder}/auto.npy", mode="w+", dtype=numpy_dtype,
                                               shape=(total, total, 2, 2))
            start = time.perf_counter()
            automatic(ids, None, out=out, progress_file=f"{folder}/auto.json", attention_mask=mask, rows=where)
            planned = time.perf_counter() - start
            measured = (f", measured {whole:.0f} s ({whole / predicted - 1:+.0%}); with the default "
                        f"batch_size='auto': {planned:.0f} s")
        print(f"| {name} | N = {total} by batch(batch_size={block}, out=<memmap>, progress_file=...), method "
              f"{method} | per block {per_block:.2f} s, per pair {pairs:.3f} s | k = 3: predicted {predicted3:.2f} s, "
              f"measured {three:.2f} s ({three / predicted3 - 1:+.0%}) | N = {total}: {predicted:.0f} s "
              f"({predicted / 60:.1f} min){measured} |", flush=True)


class _Positions(torch.nn.Module):
    """The model with the logits' positions as a keyword argument the output selector reads (the
    model itself ignores it), so that ``vmap_axes`` maps them with the examples."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, rows):
        return self.model(input_ids=input_ids, attention_mask=attention_mask)


if __name__ == "__main__":
    main()
