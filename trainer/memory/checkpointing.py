"""Gradient checkpointing of the denoiser's blocks, optionally keeping each block's attention output, optionally of
every N-th block only (``training.gradient_checkpointing_interval``, :class:`Checkpointing`).

Plain checkpointing (``training.gradient_checkpointing``) keeps none of a block's tensors for backward and runs the
whole block again there: its matmuls, norms and attention. One process uses torch's reentrant checkpoint where it
fits, which runs the first forward without autograd and so without a Python hook per saved tensor (see
:func:`checkpointed`). With ``training.checkpoint_keep_attention`` the block's
self- and joint-attention kernels (torch's scaled-dot-product attention, whichever backend it picks) are saved in the
forward and taken from there when backward recomputes the block; everything else is recomputed as before, the
cross-attention to a caption included (few keys: cheap to recompute, and its output as big to keep). This is torch's
selective activation checkpointing (``torch.utils.checkpoint.create_selective_checkpoint_contexts``) with a policy
that saves attention alone. What it costs: the attention output of every checkpointed block
(batch × tokens × the attention's width, in the compute dtype) and its softmax statistics stay alive until backward;
what it saves: one attention forward per block and step, which grows with the square of the sequence length (a
1024 px DiT, video clips). The values are the same: the kept output is the one the recomputation would have made
again (``tests/test_checkpointing_options.py``).

Kept attention costs host work in eager steps: the dispatch mode runs Python for every op of a checkpointed block's
forward and recomputation (about +4 ms per Flux double block and +2 ms per single one on a slow 2-core CPU,
``bench/checkpoint_attention.py``), which is why it is a switch.

Compiled blocks (``training.compile``, :func:`compile_checkpointed`): the checkpoint runs inside the compiled region,
not around the compiled block. torch.compile traces the checkpointed call as one region whose activations are
recomputed (the policy above, when attention is kept, decides per op at trace time), and AOTAutograd's partitioner
makes a forward that saves the block's inputs alone and a backward that recomputes and differentiates in one
compiled graph: none of the Python hooks the eager checkpoint runs for every saved tensor, and the same values as
the eager checkpoint (AOTAutograd without inductor gives the same gradients bit for bit,
``tests/test_checkpointing_options.py``). Not for FSDP's units, whose gathering hooks torch does not trace
(``trainer.train.compile.compile_blocks`` leaves them out: their checkpoint runs around the compiled call).
"""

from __future__ import annotations

import inspect
import weakref
from functools import partial
from typing import Any, Callable, Dict, Iterable, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# every aten entry point of scaled-dot-product attention (CUDA flash / memory-efficient / cuDNN, the CPU's flash), with
# the dimension of its inputs that runs along the sequence: (batch, heads, sequence, width) for the SDPA ops,
# (batch, sequence, heads, width) for the kernels' own forwards
_ATTENTION_SEQ_DIM = {"_scaled_dot_product_flash_attention": -2, "_scaled_dot_product_efficient_attention": -2,
                      "_scaled_dot_product_cudnn_attention": -2, "_scaled_dot_product_flash_attention_for_cpu": -2,
                      "_scaled_dot_product_fused_attention_overrideable": -2, "_cudnn_attention_forward": -2,
                      "_flash_attention_forward": 1, "_efficient_attention_forward": 1}
_SEQ_DIM = {getattr(torch.ops.aten, n).default: d for n, d in _ATTENTION_SEQ_DIM.items() if hasattr(torch.ops.aten, n)}
ATTENTION_OPS = frozenset(_SEQ_DIM)


def _worth_keeping(op: Any, query: Any, key: Any) -> bool:
    """Self- and joint attention (the keys about as many as the queries: recomputing costs the square of the
    sequence), not cross-attention to a caption (a few hundred keys for thousands of queries: cheap to recompute,
    and its output as big as self-attention's). Packed variable-length inputs (3-D) are kept."""
    if getattr(query, "dim", lambda: 0)() != 4 or getattr(key, "dim", lambda: 0)() != 4:
        return True
    dim = _SEQ_DIM[op]
    return 4 * key.shape[dim] >= query.shape[dim]


def _keep_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op in ATTENTION_OPS and _worth_keeping(op, args[0] if args else kwargs.get("query"),
                                              args[1] if len(args) > 1 else kwargs.get("key")):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _contexts() -> Any:
    return create_selective_checkpoint_contexts(_keep_attention)


# training.compile's blocks → the compiled checkpoint they run through (compile_checkpointed)
_COMPILED: "weakref.WeakKeyDictionary[Any, Callable[..., Any]]" = weakref.WeakKeyDictionary()


def _checkpoint(call: Callable[..., Any], keep_attention: bool, *args: Any, **kwargs: Any) -> Any:
    if keep_attention:
        return checkpoint(call, *args, use_reentrant=False, context_fn=_contexts, **kwargs)
    return checkpoint(call, *args, use_reentrant=False, **kwargs)


def _compiled_region(module: Any, keep_attention: bool, *args: Any, **kwargs: Any) -> Any:
    """What :func:`compile_checkpointed` compiles: the checkpoint of the block's own call (``_call_impl``: its
    forward and hooks, not the block's compiled call, which would nest one compiled region in another)."""
    return _checkpoint(module._call_impl, keep_attention, *args, **kwargs)


def compile_checkpointed(modules: Iterable[Any], **options: Any) -> None:
    """``training.compile`` with gradient checkpointing: when ``modules`` (the compiled blocks) are checkpointed,
    the checkpoint runs inside one torch.compile'd region (``options``: torch.compile's) instead of around each
    block's compiled call. One compiled function serves every block (a block is an input of its graph, as in
    regional compilation), so a block class compiles once per input shape."""
    compiled = torch.compile(_compiled_region, **options)
    for m in modules:
        _COMPILED[m] = compiled


# a tensor that requires grad, handed to torch's reentrant checkpoint first: backward then reaches the checkpoint (and
# the trained weights inside the block) when none of the block's inputs requires grad (the first blocks of a LoRA)
_ANCHOR = torch.ones((), requires_grad=True)
# blocks → whether they hold a trained weight (read once per block)
_TRAINS: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


_ONE, _TUPLE = object(), object()  # a block's output was one tensor / a flat tuple (handed over as it is)


class _Flat:
    """``call(*args, **kwargs)`` as torch's reentrant checkpoint runs it: after :data:`_ANCHOR`, with the keyword
    arguments that are tensors handed over as positional ones (the checkpoint tracks positional tensors alone) and
    the output's leaves as one flat tuple (it tracks the tensors of a flat tuple only; the block's own structure, a
    tuple of tuples or a diffusers output class, is rebuilt around it)."""

    def __init__(self, call: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        self.call, self.count, self.spec = call, len(args), None
        self.names = [k for k, v in kwargs.items() if torch.is_tensor(v)]
        self.fixed = {k: v for k, v in kwargs.items() if not torch.is_tensor(v)}
        # no reference to the inputs here: the checkpoint keeps this object (its run_function) as long as the step's
        # graph lives, after backward too, and the inputs it saved for backward are freed there; a reference here
        # kept every checkpointed block's input alive until the graph went, into the next step's forward

    def __call__(self, _anchor: Any, *inputs: Any) -> Any:
        kwargs = {**self.fixed, **dict(zip(self.names, inputs[self.count:]))}
        out = self.call(*inputs[:self.count], **kwargs)
        if torch.is_tensor(out):  # the usual outputs, without the general flattening's Python
            self.spec = _ONE
            return (out,)
        if type(out) is tuple and all(torch.is_tensor(t) or t is None for t in out):
            self.spec = _TUPLE
            return out
        leaves, self.spec = tree_flatten(out)
        return tuple(leaves)


def _reentrant(call: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
    flat = _Flat(call, args, kwargs)
    leaves = checkpoint(flat, _ANCHOR, *args, *(kwargs[k] for k in flat.names), use_reentrant=True)
    if flat.spec is _ONE:
        return leaves[0]
    if flat.spec is _TUPLE:
        return tuple(leaves)
    return tree_unflatten(list(leaves), flat.spec)


def _needs_grad(value: Any) -> bool:
    if torch.is_tensor(value):
        return value.requires_grad
    if isinstance(value, (list, tuple)):
        return any(_needs_grad(v) for v in value)
    return isinstance(value, dict) and any(_needs_grad(v) for v in value.values())


def _reentrant_fits(module: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    """Backward has something to reach in this call: an input that requires grad, or a trained weight in the block
    (otherwise nothing is saved and the plain checkpoint costs nothing). torch's reentrant checkpoint hands tensors
    nested in containers (Flux's rotary embedding, a pair) on as they are, not detached: one that needs a gradient
    would get it only from the backward nested inside the checkpoint's, through a graph outside it that the outer
    backward may already have run, so such a call takes the non-reentrant one."""
    inputs = (*args, *kwargs.values())
    if any(isinstance(a, (list, tuple, dict)) and _needs_grad(a) for a in inputs):
        return False
    trains = _TRAINS.get(module)
    if trains is None:
        trains = _TRAINS[module] = any(p.requires_grad for p in module.parameters())
    return trains or any(torch.is_tensor(a) and a.requires_grad for a in inputs)


def checkpointed(module: Any, *args: Any, keep_attention: bool = False, reentrant: bool = False,
                 **kwargs: Any) -> Any:
    """A checkpoint of ``module(*args, **kwargs)`` (diffusers' ``_gradient_checkpointing_func``; keyword arguments
    pass on, which diffusers 0.42.1's default function refuses: HunyuanImage's blocks take them): inside a compiled
    region where the block was compiled (:func:`compile_checkpointed`); torch's reentrant checkpoint where
    ``reentrant`` (one process) allows it (:func:`_reentrant_fits`, not with kept attention); else the non-reentrant
    one.

    The reentrant checkpoint runs the forward without autograd and saves the block's inputs; the non-reentrant one
    runs it with autograd and a Python hook for every tensor it would save (to drop it, and in backward to check the
    recomputed one): ~30 Python calls per tensor, about 3,400 tensors in a Flux.1 step. Both recompute the same ops
    with the same random state. In a chain of blocks (the DiTs) the gradients are the same bit for bit; where a
    tensor feeds a checkpointed block and something else too (a UNet's skip connections) the parts of its gradient
    are summed in another order, which changes the last bits (``tests/test_checkpointing_options.py``).
    The reentrant one runs its recomputation and backward inside the autograd engine's backward, which DDP's and
    FSDP's gradient hooks do not expect: several processes keep the non-reentrant one."""
    compiled = _COMPILED.get(module)
    if compiled is not None and not torch.compiler.is_compiling():
        return compiled(module, keep_attention, *args, **kwargs)
    if reentrant and not keep_attention and not torch.compiler.is_compiling() and _reentrant_fits(module, args, kwargs):
        return _reentrant(module.__call__, args, kwargs)
    return _checkpoint(module.__call__, keep_attention, *args, **kwargs)


class _Order(dict):
    """A :class:`Checkpointing`'s blocks → their order (a dict that can be weakly referenced)."""


# every Checkpointing's order, by id, while it lives (what _block_index reads: its arguments must be constants)
_ORDERS: "weakref.WeakValueDictionary[int, _Order]" = weakref.WeakValueDictionary()


@torch.compiler.assume_constant_result
def _block_index(order_id: int, key: int) -> int:
    """The block's place in the order it was first handed over. Under torch.compile (a whole compiled denoiser:
    ``training.compile_scope``) this runs once, while the graph is traced, and the graph keeps its result: no guard on
    the order, which the first trace fills (a guard on it made the next call compile the whole graph again)."""
    order = _ORDERS[order_id]
    return order.setdefault(key, len(order))


class Checkpointing:
    """diffusers' ``_gradient_checkpointing_func`` (``enable_gradient_checkpointing(gradient_checkpointing_func=…)``):
    the blocks a model hands it, checkpointed as :func:`checkpointed` does, every ``interval``-th of them only
    (``training.gradient_checkpointing_interval``; the others run plainly and keep their activations for backward:
    less recomputation, more memory). Blocks are counted in the order they are first handed over (a model's forward
    calls them in its own order, the same every step), so with 2 the first, third, fifth … block is checkpointed."""

    def __init__(self, keep_attention: bool = False, interval: int = 1, reentrant: bool = False):
        self.keep_attention, self.interval = bool(keep_attention), max(int(interval), 1)
        self.reentrant = bool(reentrant)
        self._order = _Order()
        _ORDERS[id(self._order)] = self._order
        self._order_id = id(self._order)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "Checkpointing":  # a copied model learns its own blocks' order
        return Checkpointing(self.keep_attention, self.interval, self.reentrant)

    def __call__(self, module: Any, *args: Any, **kwargs: Any) -> Any:
        index = _block_index(self._order_id, id(module))
        if index % self.interval:
            return module(*args, **kwargs)
        return checkpointed(module, *args, keep_attention=self.keep_attention, reentrant=self.reentrant, **kwargs)


def checkpoint_function(keep_attention: bool, interval: int = 1, reentrant: bool = False) -> Callable[..., Any]:
    if interval > 1:
        return Checkpointing(keep_attention, interval, reentrant)
    if keep_attention or reentrant:
        return partial(checkpointed, keep_attention=bool(keep_attention), reentrant=bool(reentrant))
    return checkpointed


def enable_checkpointing(module: Any, keep_attention: bool = False, interval: int = 1, reentrant: bool = False) -> None:
    """Turn on ``module``'s gradient checkpointing: a transformers model (text encoders) its own way; a diffusers model
    (and the trainer's wrappers of one) with :func:`checkpoint_function` (``reentrant``: one process, see
    :func:`checkpointed`)."""
    if hasattr(module, "gradient_checkpointing_enable"):
        module.gradient_checkpointing_enable()
        return
    enable = module.enable_gradient_checkpointing
    if "gradient_checkpointing_func" in inspect.signature(enable).parameters:
        enable(gradient_checkpointing_func=checkpoint_function(keep_attention, interval, reentrant))
    else:
        enable()


__all__ = ["ATTENTION_OPS", "Checkpointing", "checkpoint_function", "checkpointed", "compile_checkpointed",
           "enable_checkpointing"]
