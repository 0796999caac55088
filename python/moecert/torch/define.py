"""Each op of moecert.torch is defined once, as an OpDef: its forward and
backward over plain tensors (calling ops.py), what its backward keeps, and its
outputs' shapes. From a definition come

- `definition.function`: the eager torch.autograd.Function (every torch), and
- on torch >= 2.4, the custom ops torch.ops.moecert.<name> and
  <name>_backward with their fake kernels, joined by register_autograd
  (`register(lib, definitions)`), which torch.compile keeps as single ops in its graphs.

Both call the same forward and backward functions, so eager and compiled runs
give the same bits; `definition(*inputs)` picks the registered op while
torch.compile traces (library.in_graph) and the Function otherwise.
"""
import dataclasses
import functools
from typing import Callable, Tuple

import torch
from torch.autograd.function import once_differentiable

def first_order(backward):
    """backward as is while the engine records no graph of the gradients (create_graph=False),
    else under once_differentiable: double backward is refused."""
    once = once_differentiable(backward)

    @functools.wraps(backward)
    def run(ctx, *grads):
        return once(ctx, *grads) if torch.is_grad_enabled() else backward(ctx, *grads)

    return run


@dataclasses.dataclass
class OpDef:
    """One op. forward(*inputs) -> list of outputs; keep(inputs, outputs) -> (tensors, extras):
    what the backward reads (tensors saved by autograd, extras any schema-typed values);
    backward(*tensors, *grads, *extras[, wanted]) -> one gradient per entry of `grads_of`, where
    grads are the incoming gradients of the outputs `from_outputs`; a `selective` backward also
    takes `wanted` (a bool per entry of grads_of: autograd's needs_input_grad) and computes only
    those (any tensor where not wanted); results after the gradients go to `receive`. fake and
    backward_fake: the same signatures, returning empty tensors of the outputs' shapes and
    dtypes. `schema` and `backward_schema` are the custom ops' (torch.library) argument lists and
    results."""
    name: str
    schema: str
    backward_schema: str
    forward: Callable
    backward: Callable
    keep: Callable
    fake: Callable
    backward_fake: Callable
    grads_of: Tuple[int, ...]      # the inputs that get gradients
    from_outputs: Tuple[int, ...]  # the outputs whose gradients the backward reads
    integer_outputs: Tuple[int, ...] = ()
    selective: bool = False  # the backward's last argument: which of grads_of autograd asks for
    receive: Callable = None  # receive(extras, rest): the backward's results after the gradients
    function: type = None

    def __post_init__(self):
        self.function = _function(self)

    def __call__(self, *inputs):
        from . import library
        if library.in_graph():
            return tuple(getattr(torch.ops.moecert, self.name)(*inputs))
        return self.function.apply(*inputs)

    def run_backward(self, call, ctx, grads):
        """autograd's gradients of the inputs (None where not asked for) from call(*arguments),
        the definition's backward or its registered op, over what ctx kept."""
        if len(grads) == 1 and isinstance(grads[0], (list, tuple)):
            grads = tuple(grads[0])
        args = list(ctx.saved_tensors) + [grads[i] for i in self.from_outputs] + list(ctx.extras)
        wanted = [bool(ctx.needs_input_grad[i]) for i in self.grads_of]
        if self.selective:
            args.append(wanted)
        results = call(*args)
        if self.receive is not None:
            self.receive(ctx.extras, results[len(self.grads_of):])
        out = [None] * ctx.n_inputs
        for i, g, w in zip(self.grads_of, results, wanted):
            out[i] = g if w else None
        return tuple(out)


def _function(d):
    """The eager autograd.Function of definition d."""

    def forward(ctx, *inputs):
        outputs = d.forward(*inputs)
        ctx.mark_non_differentiable(*(outputs[i] for i in d.integer_outputs))
        tensors, ctx.extras = d.keep(inputs, outputs)
        ctx.save_for_backward(*tensors)
        ctx.n_inputs = len(inputs)
        return tuple(outputs)

    @first_order
    def backward(ctx, *grads):
        return d.run_backward(d.backward, ctx, grads)

    name = "".join(part.capitalize() for part in d.name.split("_"))
    return type(name, (torch.autograd.Function,), {
        "__doc__": "The eager autograd.Function of moecert::{} (define.py).".format(d.name),
        "forward": staticmethod(forward), "backward": staticmethod(backward)})


def register(lib, definitions):
    """Registers each definition as torch.library custom ops (torch >= 2.4)."""
    for d in definitions:
        _register(lib, d)


def _register(lib, d):
    forward = lib.custom_op("moecert::" + d.name, mutates_args=(), schema=d.schema)(lambda *a: list(d.forward(*a)))
    forward.register_fake(lambda *a: list(d.fake(*a)))
    backward = lib.custom_op("moecert::" + d.name + "_backward", mutates_args=(), schema=d.backward_schema)(
        lambda *a: list(d.backward(*a)))
    backward.register_fake(lambda *a: list(d.backward_fake(*a)))
    op_backward = getattr(torch.ops.moecert, d.name + "_backward")

    def setup_context(ctx, inputs, output):
        tensors, ctx.extras = d.keep(inputs, output)
        ctx.save_for_backward(*tensors)
        ctx.n_inputs = len(inputs)

    def autograd_backward(ctx, *grads):
        return d.run_backward(op_backward, ctx, grads)

    lib.register_autograd("moecert::" + d.name, autograd_backward, setup_context=setup_context)
