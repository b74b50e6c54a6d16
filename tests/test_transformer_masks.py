"""Hugging Face transformers with padding masks run under ``vmap``, not in an example loop (NOTE:
[Attention masks under vmap] in ``torchntk/_model/wrappers.py``): BERT, RoBERTa, GPT-2 and a
Llama-style model, with ``attn_implementation`` "sdpa" and "eager", right and left padding, each
kernel against the float64 brute force."""

from __future__ import annotations

import functools
import sys
import warnings

import pytest
import torch

import torchntk
from tests import zoo
from tests.cases import DEVICE, to_device
from torchntk.testing import ModuleSnapshot, assert_kernels_close, reference_ntk

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # PyTorch's vmap performance notes


def _configs(transformers, attention: str) -> dict:
    small = dict(num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, attn_implementation=attention)
    return {
        "bert": lambda: transformers.BertForSequenceClassification(transformers.BertConfig(
            vocab_size=50, hidden_size=16, max_position_embeddings=16, num_labels=3, **small)),
        "roberta": lambda: transformers.RobertaForSequenceClassification(transformers.RobertaConfig(
            vocab_size=50, hidden_size=16, max_position_embeddings=20, num_labels=3, pad_token_id=1, **small)),
        "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=16, bos_token_id=0, eos_token_id=0,
            attn_implementation=attention)),
        "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=50, hidden_size=16, num_key_value_heads=1, max_position_embeddings=16, **small)),
    }


@functools.lru_cache(maxsize=None)
def _problem(name: str, attention: str, padding: str):
    transformers = zoo.import_transformers()
    torch.manual_seed(0)
    model = _configs(transformers, attention)[name]().eval().to(DEVICE)
    ids = torch.randint(2, 50, (3, 6))
    mask = torch.ones(3, 6, dtype=torch.long)
    if padding == "right":
        mask[1, 4:] = 0
    else:
        mask[1, :2] = 0
    return model, to_device(ids), to_device(mask)


def _logits(output, input_ids, attention_mask, padding: str):
    """Sequence classifiers' logits; causal LMs' first 3 logits at the last real token."""
    logits = output.logits
    if logits.ndim == 2:
        return logits
    n, length = input_ids.shape
    last = attention_mask.sum(-1) - 1 if padding == "right" else torch.full((n,), length - 1, device=logits.device)
    return logits[torch.arange(n, device=logits.device), last][:, :3]


class _Reference(torch.nn.Module):
    def __init__(self, model, padding):
        super().__init__()
        self.model, self.padding = model, padding

    def forward(self, inputs):
        ids, mask = inputs
        return _logits(self.model(input_ids=ids, attention_mask=mask), ids, mask, self.padding)


@pytest.mark.parametrize("implementation", [1, 3])
@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ["bert", "roberta", "gpt2", "llama"])
def test_masked_transformer_runs_under_vmap_and_is_exact(name, attention, padding, implementation):
    model, ids, mask = _problem(name, attention, padding)
    snapshot = ModuleSnapshot.of(model)
    output_fn = functools.partial(_logits, padding=padding)
    ntk_fn = torchntk.empirical_ntk_fn(
        model, trace_axes=(), vmap_axes=(0, 0, {"attention_mask": 0}), implementation=implementation,
        output_fn=output_fn,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", torchntk.ExampleLoopWarning)  # the batched path, no loop
        kernel = ntk_fn(ids, None, attention_mask=mask)
    expected = reference_ntk(_Reference(model, padding), (ids, mask), None, trace_axes=())
    if not torch.isfinite(expected).all():
        # Llama's eager attention with left padding: in float64 the fully masked rows of the padding
        # positions give NaN (mask minimum plus scores is -inf), which reaches every derivative.
        # The float32 model has none; compare with the whole-batch kernel, computed without vmap.
        assert (name, attention, padding) == ("llama", "eager", "left")
        expected = torchntk.empirical_ntk_fn(model, trace_axes=(), output_fn=output_fn)(ids, None, attention_mask=mask)
    assert_kernels_close(kernel.double(), expected.double(), rtol=1e-4, atol=1e-5 * expected.abs().max().item())
    snapshot.assert_unchanged()


def test_the_mask_functions_are_restored_and_other_threads_keep_them():
    transformers = zoo.import_transformers()
    masks = sys.modules["transformers.masking_utils"]
    originals = (masks._ignore_causal_mask_sdpa, masks._ignore_bidirectional_mask_sdpa)
    model, ids, mask = _problem("gpt2", "sdpa", "right")
    torchntk.empirical_ntk_fn(model, vmap_axes=(0, 0, {"attention_mask": 0}), output_fn=functools.partial(
        _logits, padding="right"))(ids, None, attention_mask=mask)
    assert (masks._ignore_causal_mask_sdpa, masks._ignore_bidirectional_mask_sdpa) == originals
    assert transformers is not None
