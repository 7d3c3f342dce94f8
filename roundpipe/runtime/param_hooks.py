"""Autograd hooks registered on a model's parameters, run as eager PyTorch runs them.

Eager runs a parameter's tensor hooks (``p.register_hook(fn)``) once per backward, on the
gradient that backward computed for ``p`` (every use summed), before adding it to
``p.grad``; then its post-accumulate-grad hooks (``p.register_post_accumulate_grad_hook``)
with ``p.grad`` holding the sum.  What one backward is depends on the front end:

* ``forward_backward`` is compared with eager's per-microbatch loop: one backward per
  microbatch.  The tensor hooks of a parameter read by one layer unit run on the device,
  on that unit's leaf, whose gradient there is the microbatch's whole gradient (nothing
  more is moved).  A hooked parameter read by several units (tied weights, a shared
  layer), or one with post-accumulate hooks, has its gradient downloaded per (microbatch,
  unit) instead; the commit folds each microbatch's contributions in descending unit order
  (the same fold whatever the device count), runs the tensor hooks on that sum, adds it to
  ``.grad`` and runs the post-accumulate hooks, microbatch after microbatch.  A hook that
  is not linear in the gradient (a clamp) is therefore exact: it never sees a sum over
  microbatches.
* ``loss.backward()`` through ``pipe(x)`` is one backward of the whole batch: the commit
  folds each hooked parameter's contributions (summed over microbatches on the device) and
  runs its hooks once.
* The ``torch.compile`` backend returns parameter gradients to autograd, which runs the
  hooks itself.

A hooked parameter that ``loss_fn`` reads as well as a layer (a regularizer on a weight)
gets one microbatch gradient from both uses in eager, and its hooks run once on the sum.
The fused tail therefore runs ``loss_fn`` with such parameters replaced by hook-free
aliases (:class:`LossReads`, a torch function mode on that thread only), so ``loss_fn``'s
backward runs none of their hooks; the alias's gradient then joins the gradient of the
last unit reading the parameter inside that unit's backward, before the hooks (on the
device, or at the commit) see it.  A read the mode cannot see (a custom autograd
Function given the parameter, TorchScript) is refused before ``loss_fn``'s backward runs
(:func:`refuse_hooked_loss_reads`).  A hooked parameter only ``loss_fn`` reads needs no
alias: ``torch.autograd.grad`` runs its tensor hooks once per microbatch on its whole
gradient as it takes it, as eager does, and the commit runs its post-accumulate hooks
after adding each microbatch's (:func:`held_loss_grads`).

Hooks are read when a call (or a backward) starts, so hooks registered or removed between
calls take effect at the next one.  Tensor hooks run on gradients in the parameter's
dtype, as in eager; with ``optim_dtype`` masters the result is converted and accumulated
on the master.  Refused (:class:`~roundpipe.errors.ParameterHookError`): post-accumulate
hooks with masters (``p.grad`` stays None there: the gradient accumulates on the master),
hooks on the masters themselves, and hooks the commit would run under data parallelism
(eager DDP runs them before the all-reduce).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import CheckpointFunction

from ..errors import LossError, ParameterHookError
from ..plan import ModelProgram
from .host_state import HostState, fold_unit_grads
from .masters import raw_grad, set_raw_grad

Hook = Callable[..., Any]


def tensor_hooks(t: torch.Tensor) -> tuple[Hook, ...]:
    """``t.register_hook`` hooks, in the order autograd calls them."""
    hooks = getattr(t, "_backward_hooks", None)
    return tuple(hooks.values()) if hooks else ()


def post_accumulate_hooks(t: torch.Tensor) -> tuple[Hook, ...]:
    """``t.register_post_accumulate_grad_hook`` hooks, in the order autograd calls them."""
    hooks = getattr(t, "_post_accumulate_grad_hooks", None)
    return tuple(hooks.values()) if hooks else ()


_GRAPH_FILE = torch.autograd.graph.__file__


def _is_multi_grad_hook(hook: Hook) -> bool:
    """Whether ``hook`` is one a ``register_multi_grad_hook`` put on a tensor (its inner
    hook, "all" mode, or its wrapper, "any" mode: both defined in torch.autograd.graph)."""
    code = getattr(hook, "__code__", None)
    return code is not None and code.co_filename == _GRAPH_FILE and \
        code.co_name in ("inner_hook", "wrapped_fn")


def _while_registered(param: torch.Tensor, key: int, hook: Hook) -> Hook:
    """``hook`` (the tensor hook ``key`` of ``param``), skipped once its handle is removed:
    eager reads a parameter's hooks at every backward, so a hook that removes itself
    (or another) runs in no later microbatch."""
    def run(grad: torch.Tensor) -> Any:
        hooks = getattr(param, "_backward_hooks", None)
        return hook(grad) if hooks is not None and key in hooks else None
    return run


@dataclass(frozen=True)
class HookPlan:
    """Where one call runs the hooks of its parameters (keyed by state slot)."""

    # slot -> tensor hooks registered on the unit's leaf on the device (each microbatch's
    # backward calls them on that microbatch's gradient, before it accumulates)
    on_device: Mapping[str, tuple[Hook, ...]] = field(default_factory=dict)
    # slots whose gradients are downloaded per (microbatch, unit), not accumulated
    per_microbatch: frozenset[str] = frozenset()
    # slots whose gradients reach the commit in the parameter's dtype, unconverted: the
    # commit runs their hooks (tensor hooks not run on the device, post-accumulate hooks)
    at_commit: frozenset[str] = frozenset()
    # (forward_backward) hooked slots a unit reads -> the unit whose backward joins
    # loss_fn's part of the microbatch gradient (the last reader: its backward runs first)
    loss_joins: Mapping[str, int] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.on_device or self.per_microbatch or self.at_commit
                    or self.loss_joins)


NO_HOOKS = HookPlan()


def plan_hooks(host: HostState, program: ModelProgram, *, per_microbatch: bool,
               data_parallel: bool = False) -> HookPlan:
    """The hooks of ``program``'s trainable parameters as they are now.  With
    ``per_microbatch`` (``forward_backward``) each microbatch is one backward; otherwise
    the whole call is.  Raises :class:`ParameterHookError` for what cannot be exact."""
    state = host.shared
    _refuse_master_hooks(state)
    # Every call reads this: what a call without hooks pays is one look per parameter.
    tensors = host.tensors
    hooked = [slot for slot in host.specs
              if getattr(tensors[slot], "_backward_hooks", None)
              or getattr(tensors[slot], "_post_accumulate_grad_hooks", None)]
    if not hooked:
        return NO_HOOKS
    readers = collections.Counter(s for u in program.units for s in u.state)
    last_reader = {s: u.index for u in program.units for s in u.state}
    on_device: dict[str, tuple[Hook, ...]] = {}
    loss_joins: dict[str, int] = {}
    per_mb: set[str] = set()
    at_commit: set[str] = set()
    for slot in hooked:
        spec = host.specs[slot]
        if not host.trainable(slot):
            continue
        param = tensors[slot]
        hooks, post = tensor_hooks(param), post_accumulate_hooks(param)
        if any(_is_multi_grad_hook(h) for h in hooks):
            raise ParameterHookError(
                f"parameter {spec.fqn!r} is one of the tensors of a "
                "torch.autograd.graph.register_multi_grad_hook: roundpipe runs a "
                "parameter's hooks on its gradient outside the backward that reaches the "
                "parameter itself (on the device's copy, or on the host at the commit), "
                "where that hook cannot count the tensors the backward will reach, so it "
                "would never be called (eager calls it once per backward: once per "
                "microbatch under forward_backward). Nothing was run. Ways out: a hook on "
                "each parameter (p.register_hook runs once per microbatch, as in eager), "
                "or do the work in the function passed to pipe.step, on the gradients of "
                "pipe.optim_named_parameters()")
        if post and state.has_masters:
            raise ParameterHookError(
                f"parameter {spec.fqn!r} has a post-accumulate-grad hook, but with "
                f"optim_dtype={state.optim_dtype} its gradient accumulates on its master "
                "(pipe.optim_parameters()), never on the parameter, whose .grad stays None. "
                "Do that work on the masters' .grad in the function you pass to pipe.step "
                "(it runs once the call's gradients are summed), or use optim_dtype=None "
                "(the parameters are then the masters and their hooks run as in eager)")
        if per_microbatch and readers[slot]:
            loss_joins[slot] = last_reader[slot]
        if per_microbatch and hooks and readers[slot] == 1:
            on_device[slot] = tuple(_while_registered(param, key, hook)
                                    for key, hook in param._backward_hooks.items())
        if per_microbatch and (post or (hooks and readers[slot] > 1)):
            per_mb.add(slot)
            at_commit.add(slot)
        elif not per_microbatch:
            at_commit.add(slot)
    if data_parallel and at_commit:
        name = host.specs[sorted(at_commit)[0]].fqn
        raise ParameterHookError(
            f"parameter {name!r} has hooks that roundpipe runs on the host when it commits "
            "the gradients (post-accumulate-grad hooks, tensor hooks of a parameter read by "
            "several layers, or any hook under pipe(x) + backward()); under data "
            "parallelism the commit follows the all-reduce, where eager DDP runs them "
            "before it. Remove the hooks, or apply them in the function passed to "
            "pipe.step")
    return HookPlan(on_device, frozenset(per_mb), frozenset(at_commit), loss_joins)


# Not a read of the value: the parameter's own .grad, hooks registered on it.
_NOT_READS = frozenset({torch.Tensor.grad.__get__, torch.Tensor.grad.__set__,
                        torch.Tensor.register_hook,
                        torch.Tensor.register_post_accumulate_grad_hook})


class LossReads(TorchFunctionMode):
    """While active (on the fused tail's thread, around one microbatch's ``loss_fn``),
    every torch function given one of ``params`` (slot -> the model's parameter) gets a
    hook-free alias instead (same storage, a leaf of its own), so ``loss_fn``'s backward
    leaves that part of the gradient on the alias, not on the parameter through its hooks.
    ``aliases``: slot -> the alias of each parameter ``loss_fn`` read."""

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self.slots = {id(p): slot for slot, p in params.items()}
        self.params = params
        self.aliases: dict[str, torch.Tensor] = {}

    def _swap(self, t: torch.Tensor) -> torch.Tensor:
        slot = self.slots.get(id(t))
        if slot is None or self.params[slot] is not t:
            return t
        alias = self.aliases.get(slot)
        if alias is None:
            alias = self.aliases[slot] = t.detach().requires_grad_(t.requires_grad)
        return alias

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in _NOT_READS:
            args, kwargs = pytree.tree_map_only(torch.Tensor, self._swap, (args, kwargs))
        return func(*args, **kwargs)


def loss_leaves(loss: torch.Tensor) -> list[torch.Tensor]:
    """The leaves ``loss``'s backward would accumulate into (its graph's AccumulateGrad
    nodes), found by walking the graph; in the fused tail that is ``loss_fn``'s own part
    (the model's outputs are leaves there), a few nodes.

    Raises :class:`~roundpipe.errors.LossError` for a reentrant
    ``torch.utils.checkpoint`` in that graph: its backward runs a backward of its own
    that accumulates into whatever the checkpointed code read (the model's parameters
    too) out of sight of this walk, and it cannot run under ``torch.autograd.grad``."""
    leaves: list[torch.Tensor] = []
    seen: set[Any] = set()
    stack = [loss.grad_fn] if loss.grad_fn is not None else []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.name() == "torch::autograd::AccumulateGrad":  # a leaf's
            leaves.append(node.variable)
            continue
        if getattr(node, "_forward_cls", None) is CheckpointFunction:
            raise LossError(
                "loss_fn runs torch.utils.checkpoint with use_reentrant=True: its backward "
                "runs a backward of its own that writes the gradients of the parameters "
                "the checkpointed code reads straight into their .grad, where roundpipe "
                "cannot hold them for the call (a failing microbatch would leave them, "
                "data parallelism would not all-reduce them), and it cannot run under "
                "torch.autograd.grad. Nothing was committed. Pass use_reentrant=False "
                "(the same gradients)")
        stack.extend(n for n, _ in node.next_functions)
    return leaves


def _multi_grad_hook_fn(hook: Hook) -> Hook | None:
    """The user's function behind ``hook`` when ``hook`` is one of the per-tensor hooks
    ``torch.autograd.graph.register_multi_grad_hook(..., mode="all")`` registers (they
    ask the engine about every tensor's node when the first of them runs), else None."""
    if (getattr(hook, "__module__", None) != "torch.autograd.graph"
            or "register_multi_grad_hook" not in getattr(hook, "__qualname__", "")):
        return None
    code = getattr(hook, "__code__", None)
    cells = getattr(hook, "__closure__", None) or ()
    if code is None or "fn" not in code.co_freevars:
        return hook
    try:
        return cells[code.co_freevars.index("fn")].cell_contents
    except (IndexError, ValueError):  # an empty cell
        return hook


def refuse_leaf_multi_grad_hooks(leaves: Sequence[tuple[str, torch.Tensor]]) -> None:
    """A ``register_multi_grad_hook`` (mode "all") over one of ``leaves`` ((what it is,
    a leaf of ``loss_fn``'s graph)), when the fused tail takes ``loss_fn``'s gradients
    with ``torch.autograd.grad`` (it read a parameter of the pipe's model): the hook
    would fail in torch ("a leaf node was passed to _will_engine_execute_node") after
    the hooks before it ran.  Refused before that backward: the call commits nothing."""
    for what, leaf in leaves:
        for hook in tensor_hooks(leaf):
            fn = _multi_grad_hook_fn(hook)
            if fn is None:
                continue
            name = getattr(fn, "__qualname__", None) or repr(fn)
            raise LossError(
                f"torch.autograd.graph.register_multi_grad_hook(..., {name}) is registered "
                f"over {what}, a leaf of loss_fn's graph (the model output loss_fn gets "
                "is a leaf there, as are the label and loss_fn's own tensors that "
                "require grad), and loss_fn reads a parameter of the pipe's model: "
                "roundpipe then takes loss_fn's gradients with torch.autograd.grad, "
                "under which torch cannot run a multi-grad hook over a leaf. Nothing was "
                "committed. Register the hook over tensors loss_fn computes (out * 1 for "
                "the output), use mode=\"any\", or read the parameter inside the "
                "model's forward")


def accumulate_as_autograd(leaves: Sequence[torch.Tensor],
                           grads: Sequence[torch.Tensor | None]) -> None:
    """What ``loss.backward()`` does at each of ``leaves`` (tensors of ``loss_fn``'s own),
    given the gradient ``torch.autograd.grad`` took for it (running its tensor hooks).

    A leaf without tensor hooks gets its gradient from autograd's own AccumulateGrad
    node, run by a backward rooted there: the hooks on that node, the addition to
    ``.grad`` and the post-accumulate-grad hooks, as eager runs them.  That node would
    run the tensor hooks a second time, so a leaf with tensor hooks has its gradient
    added here as AccumulateGrad adds it (a fresh tensor laid out as the leaf, or in
    place), then its post-accumulate-grad hooks run; hooks registered on its
    AccumulateGrad node itself (``get_gradient_edge(t).node``) do not run then."""
    edges, roots = [], []
    for leaf, grad in zip(leaves, grads):
        if grad is None:
            continue
        if not tensor_hooks(leaf):
            edges.append(torch.autograd.graph.get_gradient_edge(leaf))
            roots.append(grad)
            continue
        with torch.no_grad():
            current = leaf.grad
            if current is None:  # never aliases what autograd or a hook returned
                leaf.grad = (grad.clone() if grad.layout != torch.strided else
                             torch.empty_like(leaf, memory_format=torch.preserve_format)
                             .copy_(grad))
            elif current.layout != torch.strided and grad.layout == torch.strided:
                leaf.grad = grad + current
            else:
                current += grad
        for hook in post_accumulate_hooks(leaf):
            hook(leaf)
    if edges:
        torch.autograd.backward(edges, roots)


def refuse_hooked_loss_reads(read: Mapping[str, torch.Tensor],
                             names: Mapping[str, str]) -> None:
    """A hooked parameter of ``names`` (slot -> name) among ``read`` (the parameters
    still in the loss's graph, :func:`loss_leaves`): ``loss_fn`` read it where
    :class:`LossReads` could not see (a custom autograd Function given it, TorchScript,
    code run with torch functions disabled), and its backward would run the hooks on
    ``loss_fn``'s part alone.  Raised before that backward: the call commits nothing."""
    for slot in read:
        if slot in names:
            raise ParameterHookError(
                f"parameter {names[slot]!r} has hooks and is read both by the model "
                "and by loss_fn in a way roundpipe cannot see (a custom autograd "
                "Function given the parameter, TorchScript, or torch functions "
                "disabled): loss_fn's backward would run its hooks on loss_fn's part "
                "of the gradient alone, where eager runs them once on the "
                "microbatch's whole gradient. Nothing was committed. Read the "
                "parameter through torch operations in loss_fn, read it inside the "
                "model's forward, or remove the hook")


def refuse_unreached(host: HostState, handed: Iterable[str],
                     param_grads: Mapping[str, Any]) -> None:
    """A hooked parameter whose gradient goes to autograd (no masters) but that this
    backward did not reach (it feeds only outputs the loss ignores): autograd would call
    its hooks with None, where eager does not call them. Refused before any commit."""
    missing = [host.specs[s].fqn for s in sorted(handed) if not param_grads.get(s)]
    if missing:
        raise ParameterHookError(
            f"parameter {missing[0]!r}" + (f" (and {len(missing) - 1} more)"
                                           if len(missing) > 1 else "")
            + " has hooks but gets no gradient from this backward through the pipe (it "
            "feeds only outputs the loss does not use); roundpipe hands a hooked "
            "parameter's gradient to autograd, which would call its hooks with None, "
            "where eager PyTorch does not call them. Nothing was committed. Remove those "
            "hooks for this backward, or use optim_dtype masters (the hooks then run at "
            "roundpipe's commit, on the parameters that got a gradient)")


def _refuse_master_hooks(state: Any) -> None:
    if not state.has_masters:
        return  # the masters are the parameters
    for name, master in state.masters().items():
        if tensor_hooks(master) or post_accumulate_hooks(master):
            raise ParameterHookError(
                f"the master of {name!r} (pipe.optim_parameters()) has a hook; gradients "
                "are written to the masters, not computed by autograd there, so it would "
                "never run. Register tensor hooks on the model's parameter (they run on "
                "each backward's gradient in the model's dtype), or do the work in the "
                "function passed to pipe.step")


@dataclass
class _Hooked:
    name: str                    # the parameter's name (the masters' key)
    param: torch.Tensor          # the model's parameter, which holds the hooks
    totals: list[tuple[int, torch.Tensor]]  # (backward, gradient after its tensor hooks)


def run_tensor_hooks(host: HostState, plan: HookPlan,
                 param_grads: Mapping[str, Sequence[tuple[int, torch.Tensor]]],
                 mb_grads: Mapping[str, Sequence[tuple[int, int, torch.Tensor]]]
                 ) -> tuple[dict[str, Sequence[tuple[int, torch.Tensor]]], list[_Hooked]]:
    """The first half of a commit, before anything is written: the gradients the
    commit adds as usual, and for each parameter the commit hooks, its per-backward
    gradients with its tensor hooks applied (an error in a hook commits nothing)."""
    rest = {s: g for s, g in param_grads.items() if s not in plan.at_commit}
    hooked: list[_Hooked] = []
    # In backward order: a parameter's gradient is complete once the backward passed
    # the first unit that reads it.
    first_reader = {s: min(uid for uid, _ in g) for s, g in param_grads.items()}
    for s, g in mb_grads.items():
        first_reader[s] = min(uid for _, uid, _ in g)
    for slot in sorted(plan.at_commit, key=lambda s: (-first_reader.get(s, -1), s)):
        if slot in plan.per_microbatch:
            by_mb: dict[int, list[tuple[int, torch.Tensor]]] = {}
            for mb, uid, g in mb_grads.get(slot, ()):
                by_mb.setdefault(mb, []).append((uid, g))
            groups = sorted(by_mb.items())
        else:
            groups = [(0, list(param_grads[slot]))] if slot in param_grads else []
        if not groups:
            continue
        param = host.tensors[slot]
        dtype = host.grad_dtype(slot)
        totals = []
        with torch.no_grad():
            for backward, group in groups:
                # summed in the parameter's dtype, as autograd sums its uses
                grad = folded = fold_unit_grads(group, fresh=True)
                # read at each backward, as eager does (a hook may remove itself)
                for hook in () if slot in plan.on_device else tensor_hooks(param):
                    out = hook(grad)
                    if out is not None:
                        _check_hook_result(host.specs[slot].fqn, grad, out)
                        grad = out
                # .grad never aliases a tensor a hook returned and may still hold
                totals.append((backward, grad.to(dtype, copy=grad is not folded)))
        hooked.append(_Hooked(host.specs[slot].fqn, param, totals))
    return rest, hooked


def run_merged_tensor_hooks(
        calls: Sequence[tuple[HostState, HookPlan,
                              Mapping[str, Sequence[tuple[int, torch.Tensor]]]]]
) -> tuple[list[dict[str, Sequence[tuple[int, torch.Tensor]]]], list[_Hooked]]:
    """:func:`run_tensor_hooks` for every pipelined call one backward pass reached
    (``pipe(x)`` + ``backward()`` with masters): a hooked parameter's gradient is each
    call's contributions folded in descending unit order, summed over the calls in the
    order the backward reached them, and its tensor hooks run once on that sum, as
    eager's one backward runs them.  Returns each call's other gradients, and the hooked
    ones (one backward)."""
    rests: list[dict[str, Sequence[tuple[int, torch.Tensor]]]] = []
    totals: dict[str, torch.Tensor] = {}
    where: dict[str, tuple[HostState, str]] = {}
    with torch.no_grad():
        for host, plan, grads in calls:
            rests.append({s: g for s, g in grads.items() if s not in plan.at_commit})
            first_reader = {s: min(uid for uid, _ in g) for s, g in grads.items()}
            for slot in sorted(plan.at_commit & grads.keys(),
                               key=lambda s: (-first_reader[s], s)):
                name = host.specs[slot].fqn
                # summed in the parameter's dtype, as autograd sums its uses
                folded = fold_unit_grads(list(grads[slot]), fresh=True)
                if name in totals:
                    totals[name] = totals[name] + folded
                else:
                    totals[name], where[name] = folded, (host, slot)
        hooked = []
        for name, total in totals.items():
            host, slot = where[name]
            param, grad = host.tensors[slot], total
            for hook in tensor_hooks(param):  # read now, as eager reads them
                out = hook(grad)
                if out is not None:
                    _check_hook_result(name, grad, out)
                    grad = out
            hooked.append(_Hooked(name, param, [(0, grad.to(host.grad_dtype(slot),
                                                             copy=grad is not total))]))
    return rests, hooked


def _check_hook_result(name: str, grad: torch.Tensor, out: Any) -> None:
    if not isinstance(out, torch.Tensor) or out.shape != grad.shape:
        raise ParameterHookError(
            f"a hook of parameter {name!r} returned "
            + (f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor)
               else f"a {type(out).__name__}")
            + f" for a gradient of shape {tuple(grad.shape)}; a tensor hook must return "
            "None or a tensor of the gradient's shape")


def held_loss_grads(host: HostState,
                    loss_grads: Mapping[str, Sequence[tuple[int, torch.Tensor]]]
                    ) -> list[_Hooked]:
    """The gradients ``loss_fn`` gave parameters no unit reads, held by the call (slot ->
    [(microbatch, gradient)], tensor hooks applied as autograd captured them), as
    :func:`accumulate` adds them: without masters one addition per microbatch, as
    eager's AccumulateGrad makes them (post-accumulate hooks after each); with masters
    their sum over the microbatches in the parameter's dtype, converted once, as a
    unit's gradient is summed on its device."""
    held = []
    with torch.no_grad():
        for slot, grads in loss_grads.items():
            if not grads:
                continue
            param = host.tensors[slot]
            # fresh tensors: .grad never aliases what autograd or a hook returned
            parts = [(mb, torch.empty_like(param).copy_(g)) for mb, g in grads]
            if host.shared.has_masters:
                total = parts[0][1]
                for _, g in parts[1:]:
                    total += g
                parts = [(0, total.to(host.grad_dtype(slot)))]
            held.append(_Hooked(host.specs[slot].fqn, param, parts))
    return held


def accumulate(host: HostState, hooked: list[_Hooked], num_backwards: int) -> None:
    """The second half: add each backward's gradient to ``.grad`` in backward order,
    running the post-accumulate hooks after each addition (``.grad`` holds the running
    sum, as in eager)."""
    state = host.shared
    backwards = sorted({b for h in hooked for b, _ in h.totals})
    with torch.no_grad():
        for h in hooked:  # a gradient held from the last call comes first
            master = state.master(h.name)
            pending = state.landed.take(h.name, master.dtype)
            if pending is not None:
                _add(master, pending)
        for backward in backwards:
            for h in hooked:
                grad = next((g for b, g in h.totals if b == backward), None)
                if grad is None:
                    continue
                master = state.master(h.name)
                _add(master, grad)
                # read after each addition, as eager does (a hook may remove itself)
                for hook in post_accumulate_hooks(h.param):
                    version = h.param._version
                    hook(h.param)
                    if h.param._version != version and backward < num_backwards - 1:
                        raise ParameterHookError(
                            f"a post-accumulate-grad hook of parameter {h.name!r} wrote the "
                            f"parameter after microbatch {backward} (an optimizer step in "
                            "backward?). Eager's next microbatch would compute with the new "
                            "value; roundpipe computed every microbatch before the hooks "
                            "ran, so the result would differ (the hook's write is kept; "
                            "this call's later gradients are not committed). Update the "
                            "parameters in the function passed to pipe.step, or use "
                            "num_microbatch=1")


def _add(master: torch.Tensor, grad: torch.Tensor) -> None:
    current = raw_grad(master)
    if current is None:
        set_raw_grad(master, grad)
    else:
        current += grad  # in place, as AccumulateGrad adds to an existing .grad
