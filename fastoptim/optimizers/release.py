"""Gradient release: each bucket of params is stepped in backward as soon as all its grads are final,
and its grads are freed there (flat grads: zeroed in place), so that a model's grads are never all held
at once. ``step()`` then steps what backward left (params whose bucket did not fill, or whose grads a
reentrant backward accumulates) and advances the per-group step counts; ``zero_grad()`` finds nothing to
clear, or ends a step whose backward raised.

A grad is final where it is known to be:

- in one process, after autograd accumulated it: a post-accumulate-grad hook of the param;
- under FSDP2 (``fully_shard``), after its unit's reduce-scatter landed: FSDP2 assigns the reduced
  local shard to the sharded param's grad and then runs that param's post-accumulate-grad hooks itself
  (``foreach_reduce``; autograd never accumulates into a sharded param), so the same hook, minus the
  reentrancy check (FSDP2 calls it from an autograd Function's backward), steps the local shards;
- under DDP, after its bucket's all-reduce completed: release registers a DDP comm hook that averages
  and all-reduces the bucket as DDP does without one, and whose future's ``then()`` makes each of the
  bucket's params' grads a view of the reduced bucket and marks them final. DDP keeps its bucket buffers
  whatever happens, so there the grads are views of them until ``step()``, which drops them.

Which models' reductions it follows, what it refuses up front, and which backward is reentrant:
``release_reductions.py``."""
from __future__ import annotations

import gc
import operator
import threading
import warnings
import weakref
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor
from torch.optim import Optimizer

from .. import flat_params
from ..clip import RELEASED
from .checks import check_in_one_group, check_params
from .release_reductions import DDPState, hook_ddp, in_reentrant_backward, reduction_mode

BUCKET_NUMEL = 1 << 22  # elements per released bucket (16 MiB of fp32 grads): DDP's default is 25 MiB

def _options(group: dict) -> dict:
    """A param group's options as a step reads them (see :func:`_held`). Not its params, nor a per-group
    count, which step() advances."""
    return {key: _held(value) for key, value in group.items() if key not in ("params", "step")}


_SEQUENCE = object()  # the mark of a tuple or list option held item by item


def _held(value) -> tuple:
    """An option's value as held to compare a later one with: a tensor with its version (a scheduler may
    write a tensor lr in place), a numpy array's copy, and a tuple or list item by item (a β1 set in a list
    of betas, or a tensor beta filled in place), or an edit in place would go unseen."""
    if isinstance(value, Tensor):  # an inference tensor has no version (and a write to it needs inference mode)
        return value, None if value.is_inference() else value._version
    if isinstance(value, np.ndarray):
        return value.copy(), None
    if isinstance(value, (tuple, list)):
        return _SEQUENCE, tuple(map(_held, value))
    return value, None


def _same(before, now) -> bool:
    """Whether an option held by :func:`_held` is unchanged: the same tensor at the same version, an equal
    value, or of a sequence, each item so."""
    if before is None or now is None:
        return before is now
    (value, mark), (value_now, mark_now) = before, now
    if value is _SEQUENCE or value_now is _SEQUENCE:
        return value is value_now and len(mark) == len(mark_now) and all(map(_same, mark, mark_now))
    if isinstance(value, Tensor) or isinstance(value_now, Tensor):
        return value is value_now and mark == mark_now
    if isinstance(value, np.ndarray) or isinstance(value_now, np.ndarray):  # its == compares element-wise
        return np.array_equal(value, value_now, equal_nan=all(np.asarray(v).dtype.kind in "fc"
                                                              for v in (value, value_now)))
    return value is value_now or value == value_now  # the same NaN is unchanged


class _Hooks:
    """The post-accumulate-grad hooks of a release, by param, and the params' marks as released
    (fastoptim.clip_grad_norm_ refuses those). It holds neither the release nor its optimizer, so that
    a finalizer of the optimizer can remove them: hooks never outlive it."""

    def __init__(self):
        self.handles = {}

    def follow(self, params: list[Tensor], hook: Callable[[Tensor], None] | None) -> None:
        """Hook exactly ``params``: unhook those that left, hook those that came (``hook`` None: mark them
        only, as under DDP, whose comm hook tells release of their grads). A param that another live
        release hooks is refused, before anything changes: both would step it in backward."""
        came = [param for param in params if param not in self.handles]
        if any(RELEASED.get(id(param)) is param for param in came):
            gc.collect()  # an optimizer dropped in a cycle (with its scheduler, say) but not collected yet
            if any(RELEASED.get(id(param)) is param for param in came):
                raise RuntimeError("fastoptim: gradient release is refused: another optimizer's release (alive, "
                                   "maybe held by its lr scheduler) steps some of these params in backward; "
                                   "call remove() on its handle first")
        kept = {id(param): param for param in params}
        for param in [param for param in self.handles if kept.get(id(param)) is not param]:
            handle = self.handles.pop(param)
            if handle is not None:
                handle.remove()
            if RELEASED.get(id(param)) is param:
                del RELEASED[id(param)]
        for param in params:
            if param not in self.handles:
                self.handles[param] = None if hook is None else param.register_post_accumulate_grad_hook(hook)
                RELEASED[id(param)] = param

    def clear(self) -> None:
        self.follow([], None)


def _weak_hook(release: GradientRelease, reduced: bool = False) -> Callable[[Tensor], None]:
    """The hook that tells ``release`` a grad arrived (``reduced``: the grad FSDP2 reduced, which it hands
    to the hook itself), holding it weakly: a param's hooks must not keep an optimizer alive (it would
    step the model in a later optimizer's backward)."""
    reference = weakref.ref(release)

    @torch._disable_dynamo  # a compiled training step runs it eagerly: it steps on real tensors, in native code
    def grad_ready(param):
        live = reference()
        if live is not None:
            live._grad_ready(param, reduced)
    return grad_ready


class GradientRelease:
    """The handle that ``optimizer.enable_gradient_release()`` returns; ``remove()`` turns it off.

    The buckets: each param group's params that require grads, in reverse order (backward reaches
    the last layers first), cut every ``bucket_numel`` elements; a group whose math needs its
    tensors together (Muon's batches of matrices) is one bucket, so its batches stay as a normal
    step makes them. They follow the groups: where a group's params or their ``requires_grad``
    changed, the first grad of the next backward, or ``step()``, makes them again, and ``step()``
    steps every param with a grad that backward did not. It holds its optimizer weakly, and the
    hooks go with the optimizer.
    """

    def __init__(self, optimizer: Optimizer, bucket_numel: int, model: torch.nn.Module | None = None):
        self._optimizer = weakref.ref(optimizer)
        self.bucket_numel = bucket_numel
        self.mode = reduction_mode(model)  # "local", "ddp" or "fsdp": where a grad is final (see the module)
        self.hooks = _Hooks()
        self._unhook = weakref.finalize(optimizer, self.hooks.clear)
        self._hook = None if self.mode == "ddp" else _weak_hook(self, reduced=self.mode == "fsdp")
        self.lock = threading.Lock()  # DDP's futures complete on the process group's threads
        self.viewed = {}  # DDP: the params whose grads are views of DDP's reduced buckets, by id
        self.late = set()  # ids of params a reentrant backward accumulated into: their buckets step at step()
        self.warned = False  # of options set between backward and step(), once
        # ids of the params whose grads release freed after stepping them (a flat grad is zeroed in place)
        # since the optimizer's last zero_grad(set_to_none=True): a loop that zeroes grads in place
        # (zero_grad(set_to_none=False)) holds a zero grad for each, which its step() steps where backward
        # gives none; ``in_place``: whether such a zero_grad came since the last step()
        self.freed, self.in_place = set(), False
        self._make_buckets(optimizer)
        self._new_step()
        if self.mode == "ddp":
            self._ddp = weakref.ref(model)
            hook_ddp(model, self)

    @property
    def optimizer(self) -> Optimizer | None:
        """The optimizer whose steps are released; None once it is gone."""
        return self._optimizer()

    def _make_buckets(self, optimizer):
        """Cut the groups' params into buckets (see the class) and hook exactly theirs; first refuse a param
        listed twice, in one group or two (written since it was added), before any bucket steps."""
        name = type(optimizer).__name__
        for group in optimizer.param_groups:
            check_params(group["params"], name)
            check_in_one_group(group, optimizer.param_groups, name)
        layout = [(list(group["params"]), list(map(flat_params.REQUIRES_GRAD, group["params"])))
                  for group in optimizer.param_groups]
        buckets = []
        for index, group in enumerate(optimizer.param_groups):
            whole = not optimizer._algorithm(group).spec.elementwise
            params, numel = [], 0
            for param in reversed([p for p in group["params"] if p.requires_grad]):
                if params and not whole and numel + param.numel() > self.bucket_numel:
                    buckets.append((index, params))
                    params, numel = [], 0
                params.append(param)
                numel += param.numel()
            if params:
                buckets.append((index, params))
        self.hooks.follow([param for _, params in buckets for param in params], self._hook)  # may refuse them
        self.layout, self.buckets = layout, buckets
        # by the params' ids (a Tensor's hash is a Python call): those of params hooked now, which hold them
        self.bucket_of = {id(param): at for at, (_, params) in enumerate(buckets) for param in params}
        self.ready = [set() for _ in self.buckets]  # ids of the params whose grads arrived this step

    def _part(self, bucket: int) -> tuple:
        """Bucket ``bucket`` as a step takes it: its step work's key in the optimizer's plan store, its
        group's index and its params."""
        return ("released", bucket), *self.buckets[bucket]

    def _made_for(self, optimizer) -> bool:
        """Whether the buckets were made for ``optimizer``'s groups as they are: the same params, with
        the same ``requires_grad``."""
        groups = optimizer.param_groups
        return len(groups) == len(self.layout) and all(
            len(group["params"]) == len(params) and all(map(operator.is_, group["params"], params))
            and list(map(flat_params.REQUIRES_GRAD, params)) == trained
            for group, (params, trained) in zip(groups, self.layout))

    def _new_step(self):
        for ready in self.ready:
            ready.clear()
        self.stepped = set()  # ids of the params stepped since the last step()
        self.options = {}  # group index: its options when backward first stepped one of its buckets
        self.checked = False  # whether this step's first grad has checked the buckets against the groups
        self.refused = False  # whether it found what step() refuses: backward then steps nothing, step() raises
        self.accumulated = None  # a grad accumulated again, found in DDP's or FSDP2's hooks: step() raises it
        self.task, self.reentrant = None, False  # the autograd graph task last seen, and whether it is reentrant

    def _grad_ready(self, param: Tensor, reduced: bool = False) -> None:
        """``param``'s grad is final: accumulated by autograd, or (``reduced``) reduced over the ranks,
        which no reentrant backward accumulates into again."""
        optimizer = self.optimizer
        if optimizer is None:
            return
        if not self.checked:
            self._check_buckets(optimizer)
        bucket = self.bucket_of.get(id(param))
        if bucket is None or self.refused or self.accumulated:  # left its group, or frozen: step() steps it
            return
        if not reduced:
            task = torch._C._current_graph_task_id()
            if task != self.task:
                self.task, self.reentrant = task, in_reentrant_backward()
            if self.reentrant:
                self.late.add(id(param))
        if id(param) in self.stepped:
            accumulate = {"ddp": "accumulate in DDP's no_sync(), ",
                          "fsdp": "accumulate under set_requires_gradient_sync(False), "}.get(self.mode, "")
            error = RuntimeError(
                "fastoptim: gradient release stepped this param since the last optimizer.step(), and a grad was "
                "accumulated into it again: a second backward (gradient accumulation), or in one backward a "
                "reentrant checkpoint (use_reentrant=True) of a param also used outside it (from the next backward "
                "on, release steps that param at step()), or a backward that raised before its step() (call the "
                "optimizer's zero_grad(), which ends that step; model.zero_grad() does not). Call optimizer.step() "
                f"after each backward, {accumulate}use use_reentrant=False, or remove the release handle to "
                "accumulate")
            if self.mode == "local":
                raise error
            # not inside DDP's comm hook or FSDP2's reduction, which would leave their other buckets and units half
            # done (helper-108: every backward after failed, or stepped other params): backward steps nothing
            # more, and step() raises it
            self.accumulated = error
            return
        ready = self.ready[bucket]
        ready.add(id(param))
        group_index, params = self.buckets[bucket]
        if len(ready) == len(params) and not any(id(p) in self.late for p in params):
            self._step([self._part(bucket)])

    def _check_buckets(self, optimizer) -> None:
        """At the first grad of a step: check every group's options (a bucket steps as soon as its grads are
        final, so a refusal found by a later bucket's step would come after the earlier ones had stepped),
        make the buckets again where the groups changed, and check their params' states. What it refuses is
        not raised here, inside autograd's (or FSDP2's, or DDP's) hook, which would leave backward, and their
        state, half done: backward steps nothing, and ``step()``, which checks the same of what it steps,
        raises it (having changed nothing)."""
        if not self.checked:
            self.checked = True
            try:
                self._check_groups(optimizer)
                optimizer._check_released_states(list(map(self._part, range(len(self.buckets)))))
            except (ValueError, TypeError, RuntimeError):
                self.refused = True

    def _check_groups(self, optimizer) -> None:
        """Raise for what a step refuses of ``optimizer``'s groups as written since (options, a max_grad_norm,
        which release refuses, a count), then make the buckets again where the groups changed (which refuses
        a param listed twice): at backward's first grad, and again at ``step()``, before anything steps."""
        optimizer._optimizer_inputs()
        for group in optimizer.param_groups:
            optimizer._check_options(group, group["params"])
        if not self._made_for(optimizer):
            self._make_buckets(optimizer)

    def _ddp_reduced(self, params: list[Tensor], grads: list[Tensor]) -> None:
        """DDP's comm hook: ``grads`` (views of a reduced DDP bucket) are ``params``' final grads. Of the
        params this release steps, a grad laid out as its view becomes the view (the grad autograd made is
        freed), another one (a flat grad, another memory format) takes its values; the others (another
        optimizer's) are DDP's to write at the end of backward."""
        with self.lock:
            optimizer = self.optimizer
            if optimizer is None:
                return
            self._check_buckets(optimizer)
            for param, grad in zip(params, grads):
                if id(param) not in self.bucket_of:
                    continue
                if param.grad is None or (param.grad.stride() == grad.stride() and not flat_params.flat_grad(param)):
                    param.grad = grad
                    self.viewed[id(param)] = param
                elif param.grad.data_ptr() != grad.data_ptr():
                    param.grad.copy_(grad)
                self._grad_ready(param, reduced=True)

    def _drop_ddp_views(self) -> None:
        """Under DDP, drop the grads that are views of DDP's buckets (flat grads, which took their values,
        are zeroed in place): DDP refuses a grad that aliases its bucket in the next backward, and
        ``zero_grad(set_to_none=False)`` would zero the reduced bucket."""
        if self.viewed:
            flat_params.zero_grads(self.viewed.values())
            self.viewed.clear()

    def _step(self, parts):
        """Step ``parts`` (per part: its step work's key in the optimizer's plan store, its group's index and
        its params), all checked before any steps, then free their grads (under DDP, at ``step()``: they are
        views of DDP's buckets, which DDP writes again at the end of backward)."""
        optimizer = self.optimizer
        for _, group_index, _ in parts:
            if group_index not in self.options:
                self.options[group_index] = _options(optimizer.param_groups[group_index])
        optimizer._step_released(parts)
        for _, _, params in parts:
            self.stepped.update(map(id, params))
            if self.mode != "ddp":
                self._free(params)

    def _free(self, params):
        """Free the grads of ``params``: a flat grad is zeroed in place (its buffer is held anyway)."""
        if not flat_params.GRAD_BUFFERS:  # no flat grad anywhere
            self.freed.update(map(id, params))
            for param in params:
                param.grad = None
            return
        self.freed.update(id(param) for param in params if not flat_params.flat_grad(param))
        flat_params.zero_grads(params)

    def _zero_freed(self, optimizer):
        """Give each param whose grad release freed a zero grad where it has none and backward did not step
        it, where the optimizer's last zero_grad zeroed grads in place: the grads that loop holds."""
        if self.in_place:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None and id(param) in self.freed and id(param) not in self.stepped:
                        param.grad = torch.zeros_like(param)

    @torch._disable_dynamo  # as the hooks: a compiled optimizer.step() runs it eagerly
    def step(self) -> None:
        """``optimizer.step()`` under release: every param with a grad that backward did not step (its
        bucket did not fill, a reentrant backward accumulated into it, or it is new to its group), on
        the grads they have, then the per-group step counts."""
        optimizer = self.optimizer
        if self.accumulated is not None:
            raise self.accumulated
        # GradScaler hands its scale, or found_inf alone where scaler.unscale_(optimizer) came first; it takes
        # them back only after a step that returns, and the next backward's steps would read them
        if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
            optimizer.__dict__.pop("grad_scale", None)
            optimizer.__dict__.pop("found_inf", None)
            raise RuntimeError("fastoptim: GradScaler scales the loss, and gradient release has already stepped "
                               "the params with the scaled grads in backward: remove the release handle to use "
                               "GradScaler")
        self._warn_of_options_set_since_backward(optimizer)
        self._check_groups(optimizer)  # written since backward (an Adan count), or refused in it: first
        with flat_params.frozen_grads_dropped(optimizer.param_groups):
            self._zero_freed(optimizer)
            rests = [(("released rest", index), index, rest) for index, group in enumerate(optimizer.param_groups)
                     if (rest := [param for param in group["params"]
                                  if param.grad is not None and id(param) not in self.stepped])]
            if rests:  # every group's checked before any steps
                self._step(rests)
        if self.mode == "ddp":
            self._drop_ddp_views()
            self._free([param for group in optimizer.param_groups for param in group["params"]
                        if id(param) in self.stepped])
        for group in optimizer.param_groups:  # the per-group counts, once
            optimizer._count_step(group, None, 1)
        self.in_place = False
        self._new_step()

    def _warn_of_options_set_since_backward(self, optimizer):
        for index, before in self.options.items():
            now = _options(optimizer.param_groups[index])
            changed = [key for key in before.keys() | now.keys() if not _same(before.get(key), now.get(key))]
            if changed and not self.warned:
                self.warned = True
                warnings.warn(
                    f"fastoptim: {', '.join(sorted(changed))} of param group {index} changed after backward had "
                    "stepped its released buckets with the values before: only what step() stepped took the new "
                    "ones. Under gradient release, set options (scheduler.step()) after optimizer.step() or "
                    "before backward. (Said once.)", stacklevel=4)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``optimizer.zero_grad(set_to_none)`` under release, before the grads are cleared: a step that a
        backward began and ``step()`` did not end (the backward raised, and a handler went on) ends here.
        The buckets it stepped keep their update, which cannot be undone (a warning says so), and the
        per-group step counts advance, as after a step in which the other params had no grads. Without
        ``set_to_none``, the params whose grads release freed since the last call with it keep a zero
        grad as far as the next ``step()`` is concerned: it steps them (weight decay, momentum) where
        backward gives them none, as it would the zero grads this call leaves without release."""
        if set_to_none:
            self.freed = set()
        self.in_place = not set_to_none
        optimizer = self.optimizer
        if self.stepped and optimizer is not None:
            warnings.warn(
                f"fastoptim: a backward since the last step() stepped {len(self.stepped)} params under gradient "
                "release, and no step() followed: one that raised, or one meant for other params that went through "
                "these (a GAN's generator loss through its released discriminator: freeze it for that backward, "
                "requires_grad_(False)). Those steps cannot be undone: zero_grad() ends that step there (the "
                "per-group step counts advance) and drops the other grads", stacklevel=4)
            for group in optimizer.param_groups:
                optimizer._count_step(group, None, 1)
        self._drop_ddp_views()
        self._new_step()

    def remove(self) -> None:
        """Turn release off: the hooks go, and ``step()`` steps the grads as usual again. Between a
        backward and ``step()``, that ``step()`` steps what backward left: the params that backward
        stepped lose their grads here (flat grads too, which release zeroes in place, and which the step
        would otherwise take again), so that none is stepped twice."""
        optimizer = self.optimizer
        self._unhook()
        ddp = self.__dict__.get("_ddp")
        ddp = None if ddp is None else ddp()
        for _, state in getattr(ddp, "_comm_hooks", []):
            if isinstance(state, DDPState):
                state.releases.discard(self)  # without releases, the hook averages, as DDP without one
        if optimizer is None:
            return
        for key, param in list(self.viewed.items()):  # DDP's reduced grads that step() takes: their own now
            if id(param) not in self.stepped and param.grad is not None:
                param.grad = param.grad.clone()
                del self.viewed[key]
        self._drop_ddp_views()
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) in self.stepped:
                    param.grad = None
        self._zero_freed(optimizer)  # what a loop that zeroes grads in place holds, which step() steps from now
        if optimizer.__dict__.get("_release") is self:
            optimizer._release = None
