"""Kernels of models as training set-ups leave them: activation checkpointing in every form that
reaches ``torch.utils.checkpoint`` (NOTE: [Checkpoints run plain]) and forward hooks that ask for
gradients (NOTE: [Hooks that ask for gradients]), on every PyTorch version of CI's matrix.

Each kernel is compared with the float64 brute force (``reference_ntk``) of a model with the same
weights and neither checkpoints nor hooks, and the user's model, PyTorch's globals and other threads
must come out as they were.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import sys
import threading
import warnings

import pytest
import torch
import torch.utils.checkpoint as checkpoint_module
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint, checkpoint_sequential  # bound at import, as user code does

import torchntk
from tests import zoo
from tests.cases import DEVICE, to_device
from torchntk.testing import ModuleSnapshot, assert_kernels_close, reference_ntk

pytestmark = [
    # peft's set-up leaves use_reentrant to PyTorch, which asks for it to be passed
    pytest.mark.filterwarnings("ignore:torch.utils.checkpoint. the use_reentrant parameter"),
    # peft's LoRA on GPT-2's Conv1D, and peft asking transformers 5 by its deprecated names
    pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to False"),
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated"),
]

IMPLEMENTATIONS = (0, 1, 2, 3)
VMAP_AXES = (0, None)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return to_device(tuple(torch.randn(n, 3, dtype=torch.float64, generator=generator) for n in (4, 3)))


def _checkpoint_globals() -> dict[str, object]:
    """What ``checkpoint`` and Hugging Face look up at every call (NOTE: [Checkpoints run plain]),
    in the modules imported now, and ``Tensor.requires_grad_``."""
    names = {
        "torch.utils.checkpoint": ("CheckpointFunction", "_checkpoint_without_reentrant_generator",
                                   "_checkpoint_without_reentrant_generator_impl", "checkpoint"),
        "transformers.modeling_utils": ("save_on_cpu", "checkpoint"),
        "torch.distributed._composable.checkpoint_activation": (
            "_checkpoint_without_reentrant_generator", "_checkpoint_without_reentrant_generator_impl"),
    }
    found = {}
    for module_name, attributes in names.items():
        module = sys.modules.get(module_name)
        for attribute in attributes:
            if module is not None and attribute in vars(module):
                found[f"{module_name}.{attribute}"] = vars(module)[attribute]
    found["Tensor.requires_grad_"] = vars(torch.Tensor).get("requires_grad_")
    return found


def _assert_restored(before: dict[str, object]) -> None:
    """The globals are those of ``before``; modules imported since hold no stand-in either (an
    import while the stand-ins were set binds them under the importer's name)."""
    after = _checkpoint_globals()
    assert {name: after[name] for name in before} == before
    assert not [name for name, value in after.items() if getattr(value, "_torchntk_stand_in", False)]


# ---------------------------------------------------------------------------------------------
# torch.utils.checkpoint, in every form user code reaches it
# ---------------------------------------------------------------------------------------------


class _DoubledTanh(TorchFunctionMode):
    """A forward context that changes values: ``tanh`` gives twice its value."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        return 2 * result if func is torch.tanh else result


def _forward_contexts():
    return _DoubledTanh(), contextlib.nullcontext()


def _selective():
    return checkpoint_module.create_selective_checkpoint_contexts([torch.ops.aten.addmm.default])


def _has_decorator_form() -> bool:
    """PyTorch 2.14 added ``checkpoint(use_reentrant=...)(fn)``."""
    return inspect.signature(checkpoint).parameters["function"].default is None


FORMS = (
    "reentrant", "non_reentrant", "default", "partial", "sequential", "sequential_reentrant", "selective",
    "forward_context", "decorator", "timm", "composable",
)


class _Checkpointed(nn.Module):
    """A block of four layers checkpointed as ``form`` says, then a head."""

    def __init__(self, form: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh())
        self.head = nn.Linear(6, 2)
        self.form = form
        if form == "partial":  # bound once, as Hugging Face's _gradient_checkpointing_func
            self.checkpointed = functools.partial(checkpoint, use_reentrant=False)
        if form == "decorator" and not _has_decorator_form():
            pytest.skip(f"torch {torch.__version__} has no decorator form of checkpoint")
        if form == "timm":
            self.checkpoint_seq = zoo.import_timm().models.checkpoint_seq
        if form == "composable":
            try:
                from torch.distributed._composable import checkpoint as composable
            except ImportError as error:
                pytest.skip(f"no composable checkpoint here: {error}")
            composable(self.block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        form, block = self.form, self.block
        if form in ("reentrant", "non_reentrant"):
            h = checkpoint(block, x, use_reentrant=form == "reentrant")
        elif form == "default":
            with warnings.catch_warnings():  # PyTorch asks for use_reentrant to be passed
                warnings.simplefilter("ignore")
                h = checkpoint(block, x)
        elif form == "partial":
            h = self.checkpointed(block, x)
        elif form in ("sequential", "sequential_reentrant"):
            h = checkpoint_sequential(block, 2, x, use_reentrant=form == "sequential_reentrant")
        elif form == "selective":
            h = checkpoint(block, x, use_reentrant=False, context_fn=_selective)
        elif form == "forward_context":
            h = checkpoint(block, x, use_reentrant=False, context_fn=_forward_contexts)
        elif form == "decorator":  # applied in forward: one bound in __init__ would hold the user's block
            h = checkpoint(use_reentrant=False)(block)(x)
        elif form == "timm":
            h = self.checkpoint_seq(block, x, use_reentrant=False)
        else:  # composable: the hooks torch.distributed._composable.checkpoint registered on the block
            h = block(x)
        return self.head(h)


class _Plain(nn.Module):
    """The same function without checkpoints (tanh doubled where the forward context doubles it)."""

    def __init__(self, model: _Checkpointed) -> None:
        super().__init__()
        self.block, self.head = copy.deepcopy(model.block), copy.deepcopy(model.head)
        for module in self.block.modules():
            module._forward_hooks.clear()
            module._forward_pre_hooks.clear()
        self.doubled = model.form == "forward_context"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with _DoubledTanh() if self.doubled else contextlib.nullcontext():
            h = self.block(x)
        return self.head(h)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("form", FORMS)
def test_checkpointed_models_are_exact(form, implementation):
    model = _Checkpointed(form).double().to(DEVICE)
    x1, x2 = _inputs()
    expected = reference_ntk(_Plain(model), x1, x2, trace_axes=())
    snapshot, globals_before = ModuleSnapshot.of(model), _checkpoint_globals()
    for vmap_axes in VMAP_AXES:
        ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=vmap_axes, implementation=implementation)
        assert_kernels_close(ntk_fn(x1, x2), expected)
    snapshot.assert_unchanged()
    _assert_restored(globals_before)


@pytest.mark.parametrize("form", FORMS)
def test_each_form_checkpoints_outside_torchntk(form):
    """The forms above are real checkpoints: a backward pass runs the block's first layer again."""
    model = _Checkpointed(form).double()
    calls = []
    model.block[0].register_forward_pre_hook(lambda *_: calls.append(1))  # recomputations may stop early
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    model(x).sum().backward()
    assert len(calls) == 2


def test_forward_errors_leave_nothing_patched():
    class Failing(_Checkpointed):
        def forward(self, x):
            return checkpoint(self.fail, x, use_reentrant=False)

        def fail(self, x):
            raise ArithmeticError("raised inside the checkpoint")

    before = _checkpoint_globals()
    with pytest.raises(ArithmeticError, match="inside the checkpoint"):
        torchntk.empirical_ntk_fn(Failing("non_reentrant").double(), vmap_axes=None, implementation=1)(*_inputs())
    _assert_restored(before)


def test_modules_imported_meanwhile_get_the_originals():
    """A module imported by the forward pass while the stand-ins are set binds them under its own
    names; it must get PyTorch's back."""
    name = "_torchntk_test_importer"

    class Importing(_Checkpointed):
        def forward(self, x):
            if name not in sys.modules:
                importer = sys.modules[name] = type(sys)(name)
                exec("from torch.utils.checkpoint import CheckpointFunction", vars(importer))
            return super().forward(x)

    try:
        torchntk.empirical_ntk_fn(Importing("reentrant").double(), vmap_axes=None, implementation=1)(*_inputs())
        assert sys.modules[name].CheckpointFunction is checkpoint_module.CheckpointFunction
        assert not getattr(checkpoint_module.CheckpointFunction, "_torchntk_stand_in", False)
    finally:
        sys.modules.pop(name, None)


def test_other_threads_keep_real_checkpoints_and_hooks():
    """While one thread computes a kernel (held inside its checkpointed block), another thread's
    checkpoints still recompute in the backward pass and its hooks still mark outputs."""
    inside, release = threading.Event(), threading.Event()

    class Held(_Checkpointed):
        def forward(self, x):
            return self.head(checkpoint(self.held, x, use_reentrant=False))

        def held(self, x):
            if not inside.is_set():
                inside.set()
                release.wait(30)
            return self.block(x)

    model = Held("non_reentrant").double().to(DEVICE)
    x1, x2 = _inputs()
    results = {}

    def compute():
        results["kernel"] = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=None, implementation=1)(x1, x2)

    worker = threading.Thread(target=compute)
    worker.start()
    try:
        assert inside.wait(30)
        calls = []

        def counted(h):
            calls.append(1)
            return torch.tanh(h)

        for use_reentrant in (False, True):
            y = torch.randn(3, dtype=torch.float64, requires_grad=True)
            checkpoint(counted, y, use_reentrant=use_reentrant).sum().backward()
        assert len(calls) == 4  # each forward ran again in its backward pass
        layer = nn.Linear(3, 3).requires_grad_(False)
        layer.register_forward_hook(lambda module, inputs, output: output.requires_grad_(True))
        assert layer(torch.randn(2, 3)).requires_grad
    finally:
        release.set()
        worker.join(60)
    assert_kernels_close(results["kernel"], reference_ntk(_Plain(model), x1, x2, trace_axes=()))


# ---------------------------------------------------------------------------------------------
# Hooks that ask for gradients
# ---------------------------------------------------------------------------------------------


class _Hooked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(3, 5), nn.Linear(5, 2)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def _mark_output(module, inputs, output):
    output.requires_grad_(True)


def _set_flag(module, inputs, output):
    output.requires_grad = True


def _mark_input(module, inputs):
    inputs[0].requires_grad_()


def _squared_by_inner_transform(module, inputs, output):
    """A hook running a ``torch.func`` transform of its own, whose own ``requires_grad_`` calls
    must go through: it returns ``output + output ** 2``."""
    return output + torch.func.grad(lambda t: (t**3).sum() / 3)(output)


class _Squared(_Hooked):
    def forward(self, x):
        h = self.first(x)
        return self.second(torch.tanh(h + h**2))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_hooks_asking_for_gradients_are_harmless(implementation):
    model = _Hooked().double().to(DEVICE)
    plain = copy.deepcopy(model)
    model.first.register_forward_hook(_mark_output)
    model.second.register_forward_hook(_set_flag)
    model.first.register_forward_pre_hook(_mark_input)
    x1, x2 = _inputs()
    expected = reference_ntk(plain, x1, x2, trace_axes=())
    snapshot = ModuleSnapshot.of(model)
    for vmap_axes in VMAP_AXES:
        ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=vmap_axes, implementation=implementation)
        kernel = ntk_fn(x1, x2)
        assert_kernels_close(kernel, expected)
    snapshot.assert_unchanged()
    assert model.first(x1).requires_grad  # the user's hook is the user's, working as before


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_transforms_inside_hooks_keep_their_derivatives(implementation):
    model = _Hooked().double().to(DEVICE)
    model.first.register_forward_hook(_squared_by_inner_transform)
    reference = _Squared().double().to(DEVICE)
    reference.load_state_dict(model.state_dict())
    x1, x2 = _inputs()
    expected = reference_ntk(reference, x1, x2, trace_axes=())
    for vmap_axes in VMAP_AXES:
        ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=vmap_axes, implementation=implementation)
        kernel = ntk_fn(x1, x2)
        assert_kernels_close(kernel, expected)


def test_hooks_on_every_module_are_harmless():
    model = _Hooked().double().to(DEVICE)
    x1, x2 = _inputs()
    expected = reference_ntk(model, x1, x2, trace_axes=())

    def mark(module, inputs, output):
        if isinstance(output, torch.Tensor) and output.is_floating_point():
            output.requires_grad_(True)

    handle = nn.modules.module.register_module_forward_hook(mark)
    try:
        for vmap_axes in VMAP_AXES:
            kernel = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=vmap_axes, implementation=1)(x1, x2)
            assert_kernels_close(kernel, expected)
    finally:
        handle.remove()


# ---------------------------------------------------------------------------------------------
# Hugging Face and peft training set-ups
# ---------------------------------------------------------------------------------------------


def _hugging_face(kind: str) -> tuple[nn.Module, object, object]:
    """A tiny model without dropout (so that training mode is deterministic) in float64, its output
    selector, and the modules LoRA adapts."""
    transformers = zoo.import_transformers()
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=16, bos_token_id=0, eos_token_id=0,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
        return transformers.GPT2LMHeadModel(config).double(), zoo.last_token_logits, ["c_attn"]
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForSequenceClassification(config).double(), (lambda out: out.logits), ["query", "value"]


def _checkpointing(**kwargs):
    def enable(model):
        with warnings.catch_warnings():  # gradient_checkpointing_enable is deprecated in transformers 5
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_enable(**kwargs)

    return enable


def _disabled(model):
    _checkpointing()(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_disable()  # the input hook stays


def _kbit_training(model):
    """peft's ``prepare_model_for_kbit_training`` as it prepares a quantized model (it installs its
    hooks only for one, and bitsandbytes is not needed to say it is: the flag is all it reads): the
    base frozen, half-precision weights cast to float32 (there are none in these float64 models),
    the input-grads hook, checkpointing with PyTorch's default ``use_reentrant``."""
    model.is_loaded_in_8bit = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            zoo.import_peft().prepare_model_for_kbit_training(model)
    finally:
        del model.is_loaded_in_8bit


SETUPS = {  # name: (set-up, training mode)
    "checkpointing": (_checkpointing(gradient_checkpointing_kwargs={"use_reentrant": False}), True),
    "checkpointing_reentrant": (_checkpointing(gradient_checkpointing_kwargs={"use_reentrant": True}), True),
    "checkpointing_default": (_checkpointing(), True),
    "checkpointing_offload": (
        _checkpointing(gradient_checkpointing_kwargs={"use_reentrant": False}, offload=True), True
    ),
    "checkpointing_eval": (_checkpointing(gradient_checkpointing_kwargs={"use_reentrant": True}), False),
    "input_require_grads": (lambda model: model.enable_input_require_grads(), False),
    "disabled": (_disabled, True),
    "kbit_lora": (_kbit_training, True),
}


def _without_setup(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with no forward hooks and no checkpointing."""
    plain = copy.deepcopy(model)
    for module in plain.modules():
        module._forward_hooks.clear()
        module._forward_pre_hooks.clear()
        if getattr(module, "gradient_checkpointing", False):
            module.gradient_checkpointing = False
    return plain


def _set_up(kind: str, setup: str) -> tuple[nn.Module, object]:
    model, output_fn, targets = _hugging_face(kind)
    prepare, training = SETUPS[setup]
    prepare(model)
    if setup == "kbit_lora":
        lora = zoo.import_peft().LoraConfig(
            r=2, lora_alpha=4, lora_dropout=0.0, target_modules=targets, init_lora_weights=False,
        )
        torch.manual_seed(1)
        model = zoo.import_peft().get_peft_model(model, lora)
    return model.train(training).to(DEVICE), output_fn


@functools.lru_cache(maxsize=None)
def _tokens() -> tuple:
    torch.manual_seed(2)
    ids1, ids2, masks = zoo._tokens(50)
    return to_device(ids1), to_device(ids2), to_device({"attention_mask": masks})


@functools.lru_cache(maxsize=None)
def _reference(kind: str, lora: bool) -> torch.Tensor:
    """The float64 brute force of the set-up model without hooks and checkpoints (the weights are
    the same for every set-up of a kind; LoRA adds the adapters)."""
    model, output_fn = _set_up(kind, "kbit_lora" if lora else "input_require_grads")
    ids1, ids2, kwargs = _tokens()
    case = zoo.Case(_without_setup(model), ids1, ids2, kwargs, None, output_fn)
    inputs1, inputs2 = zoo.reference_inputs(case)
    return reference_ntk(zoo.ReferenceModule(case), inputs1, inputs2)


def _check_setup(kind: str, setup: str, implementation: int) -> None:
    model, output_fn = _set_up(kind, setup)
    ids1, ids2, kwargs = _tokens()
    expected = _reference(kind, setup == "kbit_lora")
    snapshot, globals_before = ModuleSnapshot.of(model), _checkpoint_globals()
    for vmap_axes in ((0, 0, {"attention_mask": 0}), None):
        ntk_fn = torchntk.empirical_ntk_fn(
            model, vmap_axes=vmap_axes, implementation=implementation, output_fn=output_fn
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torchntk.ExampleLoopWarning)
            assert_kernels_close(ntk_fn(ids1, ids2, **kwargs), expected)
    snapshot.assert_unchanged()
    _assert_restored(globals_before)



@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_bert_training_setups_are_exact(setup, implementation):
    _check_setup("bert", setup, implementation)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_gpt2_training_setups_are_exact(setup, implementation):
    _check_setup("gpt2", setup, implementation)


@pytest.mark.parametrize("setup", ["checkpointing", "kbit_lora"])
def test_training_setups_with_the_defaults(setup):
    """``empirical_ntk_fn(model)`` with nothing else given (AUTO, ``vmap_axes="auto"``)."""
    model, output_fn = _set_up("gpt2", setup)
    ids1, ids2, kwargs = _tokens()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torchntk.ExampleLoopWarning)
        kernel = torchntk.empirical_ntk_fn(model, output_fn=output_fn)(ids1, ids2, **kwargs)
    assert_kernels_close(kernel, _reference("gpt2", setup == "kbit_lora"))


def test_training_setup_is_left_as_it_was():
    """Hooks, checkpointing flags and functions, ``requires_grad`` of every parameter, PyTorch's
    globals: the same objects after a kernel, and training with checkpoints still works."""
    model, output_fn = _set_up("gpt2", "kbit_lora")
    ids1, ids2, kwargs = _tokens()
    modules = dict(model.named_modules())
    hooks = {name: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for name, m in modules.items()}
    flags = {name: (vars(m).get("gradient_checkpointing"), vars(m).get("_gradient_checkpointing_func"))
             for name, m in modules.items()}
    trainable = {name: p.requires_grad for name, p in model.named_parameters()}
    attributes = {name: dict(vars(m)) for name, m in modules.items()}
    globals_before = _checkpoint_globals()
    snapshot = ModuleSnapshot.of(model)
    torchntk.empirical_ntk_fn(model, output_fn=output_fn)(ids1, ids2, **kwargs)
    snapshot.assert_unchanged()
    assert {name: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for name, m in modules.items()} == hooks
    assert {name: (vars(m).get("gradient_checkpointing"), vars(m).get("_gradient_checkpointing_func"))
            for name, m in modules.items()} == flags
    assert any(flag for flag, _ in flags.values())
    assert {name: p.requires_grad for name, p in model.named_parameters()} == trainable
    assert {name: set(vars(m)) for name, m in modules.items()} == {name: set(a) for name, a in attributes.items()}
    _assert_restored(globals_before)
    embeddings = model.get_input_embeddings()
    assert embeddings(ids1).requires_grad  # the input hook still works for the user
    model(ids1, attention_mask=kwargs["attention_mask"][0]).logits.sum().backward()  # a training step
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
