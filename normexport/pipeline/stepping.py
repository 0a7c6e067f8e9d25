"""A component method that runs a child module in a python loop, handing it a list the child updates
in place (its state across the loop): diffusers' causal video VAEs (AutoencoderKLWan,
AutoencoderKLQwenImage and every pipeline built on them):

    x = self.post_quant_conv(z)
    for i in range(num_frame):
        self._conv_idx = [0]
        out_ = self.decoder(x[:, :, i:i + 1], feat_cache=self._feat_map, feat_idx=self._conv_idx, first_chunk=i == 0)

Exported whole, torch.export traces that loop unrolled: the file fixes the frame count, and the export
grows faster than the frames (> 8 minutes for a tiny VAE at 21 latent frames,
benchmarks/results/video_pipeline_time_2026-11-28_vm.txt). Such a method is cut at its children:

1. `plan()`: the method runs in eager at the recorded call, every direct child's calls recorded (their
   arguments, the lists' contents before and after). It applies where a child's call changes a list it
   was given. The loop axis is the method input's axis that the looping child's tensors cover exactly
   (21 latent frames = 21 slices of 1); probe runs at a few loop steps (the recorded call, its
   one-prompt call, the size-up call's shapes, one step longer) tell which dims are dynamic: those
   that differ between the runs, as the recording decides for whole components.
2. A child's calls fall into kinds (`key`): the same python values, the same list layout (None, a
   marker string, tensors of the same static sizes). Wan's decoder has three: the first frame, the
   second (caches of one frame), every later one. Each kind is one file (pipeline/stepped_export.py)
   taking the call's tensors (the list's among them) and giving the child's output and the list's
   tensors after the call; the list's other entries after the call are kept in the manifest.
3. At load, `Stepped` runs the library's own method on the component built on the meta device, each
   exported child's forward replaced by a proxy that picks the file of the call's kind, runs it and
   writes the list's new contents back: the loop, the concatenation, the clamp are diffusers' own,
   so any frame count runs, in time linear in the frames.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch
from torch import nn

from . import manifest as manifest_mod

#: a step's output, when the child returns one tensor; the list entries after the call are "<param>.<i>.next"
OUT = "out"
NEXT = ".next"
#: probe runs: the loop steps each covers (the kinds a loop goes through before it repeats: Wan's has 3)
PROBE_STEPS = 4


@dataclasses.dataclass
class ChildCall:
    """One call of a direct child while the method ran."""
    child: str
    bound: dict  # parameter -> value as given (a list: its contents before the call)
    after: dict = dataclasses.field(default_factory=dict)  # list parameter -> its contents after the call
    out: object = None

    def changed(self) -> bool:
        """The call changed a list it was given (the loop's state)."""
        return any(len(a) != len(self.bound[p]) or any(not _same(x, y) for x, y in zip(a, self.bound[p]))
                   for p, a in self.after.items())

    def tensors(self) -> dict[str, torch.Tensor]:
        """{input name: tensor} of the call: a tensor parameter by its name, a list's tensor by `param.i`."""
        out = {}
        for p, v in self.bound.items():
            if isinstance(v, torch.Tensor):
                out[p] = v
            elif isinstance(v, list):
                out.update({f"{p}.{i}": t for i, t in enumerate(v) if isinstance(t, torch.Tensor)})
        return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    return type(a) is type(b) and a == b


def record(component: nn.Module, method: str, args: tuple, kwargs: dict) -> list[ChildCall]:
    """The direct children's calls while `component.method(*args, **kwargs)` runs in eager."""
    calls: list[ChildCall] = []
    open_calls: dict[str, list[ChildCall]] = {}
    handles = []
    for name, child in component.named_children():
        signature = inspect.signature(type(child).forward)

        def pre(mod, a, kw, name=name, signature=signature):
            bound = signature.bind(mod, *a, **kw).arguments
            bound.pop(next(iter(signature.parameters)))  # self
            call = ChildCall(name, {p: list(v) if isinstance(v, list) else v for p, v in bound.items()})
            call.live = {p: v for p, v in bound.items() if isinstance(v, list)}
            calls.append(call)
            open_calls.setdefault(name, []).append(call)

        def post(mod, a, kw, out, name=name):
            call = open_calls[name].pop()
            call.after = {p: list(v) for p, v in call.live.items()}
            call.out = out
            del call.live

        handles.append(child.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(child.register_forward_hook(post, with_kwargs=True))
    try:
        with torch.no_grad():
            getattr(component, method)(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return calls


def key(call: ChildCall, dynamic: dict) -> str:
    """The call's kind, as text: its child, each parameter's python value or, for a tensor, dtype and
    sizes (a dynamic dim as '?'), for a list each entry so. `dynamic`: {child: {input name: [axes]}}."""
    axes = dynamic.get(call.child, {})

    def one(name, v):
        if isinstance(v, torch.Tensor):
            dims = ",".join("?" if a in axes.get(name, []) else str(d) for a, d in enumerate(v.shape))
            return f"{str(v.dtype).replace('torch.', '')}[{dims}]"
        if isinstance(v, list):
            return "[" + ";".join(one(f"{name}.{i}", e) for i, e in enumerate(v)) + "]"
        return repr(v)

    return call.child + "(" + ", ".join(f"{p}={one(p, v)}" for p, v in sorted(call.bound.items())) + ")"


@dataclasses.dataclass
class Plan:
    """What `plan` found: the dynamic dims, the kinds to export."""
    dynamic: dict  # {child: {input name: [axes]}}
    kinds: dict  # key -> the first call of that kind (the file's example)
    loop_axis: tuple  # (method input name, axis) the loop walks
    children: list  # the children the method called, in order first called


def may_loop(component: nn.Module) -> bool:
    """A direct child whose forward takes a state: a parameter with a list default (Wan's `feat_idx=[0]`) or
    named as a cache (`feat_cache`): plan() runs the method only for such a component."""
    for child in component.children():
        params = list(inspect.signature(type(child).forward).parameters.values())[1:]
        if any(isinstance(p.default, list) or "cache" in p.name for p in params):
            return True
    return False


def plan(component: nn.Module, method: str, args: tuple, kwargs: dict, others: list[tuple]) -> Plan | str | None:
    """The plan for a method that runs a child in a loop over a list it updates (module doc), None
    where no child's call changes a list or the loop ran once (the method is exported whole: exact for
    its call), or a phrase saying why the
    loop cannot be cut. `others`: the recorded calls of other shapes ((args, kwargs), the one-prompt
    call, the size-up call), which tell the dynamic dims."""
    main = record(component, method, args, kwargs)
    looped = [c for c in main if c.changed()]
    if not looped or sum(c.child == looped[0].child for c in main) < 2:
        return None  # no loop, or one of a single step (an image through a video VAE): exported whole, exact
    bound = _bind_method(component, method, args, kwargs)
    loop = _loop_axis(bound, [c for c in main if c.child == looped[0].child])
    if loop is None:
        return (f"no input of {method} is walked by {looped[0].child}'s calls ({len(looped)} of them) slice by "
                "slice")
    name, axis, sizes = loop
    runs = [record(component, method, (), _steps(b, name, axis, sizes)) for b in
            [bound] + [_bind_method(component, method, *o) for o in others]]
    longer = record(component, method, (), _steps(bound, name, axis, sizes, extra=1))
    dynamic: dict = {}
    for run in [main] + runs[1:] + [longer]:  # the probes against the first: a dim that differs is dynamic
        _differ(runs[0], run, dynamic)
    kinds: dict = {}
    for c in main + longer:
        kinds.setdefault(key(c, dynamic), c)
    steps = [key(c, dynamic) for c in longer if c.child == looped[0].child]
    if len(steps) < 2 or steps[-1] != steps[-2]:
        return f"{looped[0].child}'s calls do not repeat within {PROBE_STEPS} loop steps ({len(set(steps))} kinds)"
    unknown = [key(c, dynamic) for r in runs for c in r if key(c, dynamic) not in kinds]
    if unknown:
        return f"a call of another shape is of a kind the recorded run does not make ({unknown[0][:120]})"
    children = list(dict.fromkeys(c.child for c in main))
    return Plan(dynamic, kinds, (name, axis), children)


def _bind_method(component, method, args, kwargs) -> dict:
    sig = inspect.signature(getattr(component, method))
    return dict(sig.bind(*args, **kwargs).arguments)


def _loop_axis(bound: dict, calls: list[ChildCall]):
    """(input name, axis, the sizes each call took along it) where the looping child's first tensors,
    one per call, cover an input of the method exactly along one axis (Wan's decode: 21 slices of 1
    of its 21 latent frames; its encode: 1 + 20 x 4 of 81 frames)."""
    firsts = [next(iter(c.tensors().values()), None) for c in calls]
    if any(t is None for t in firsts):
        return None
    for name, t in bound.items():
        if not isinstance(t, torch.Tensor):
            continue
        for axis in range(t.dim()):
            sizes = [f.shape[axis] if f.dim() == t.dim() else -1 for f in firsts]
            if min(sizes) > 0 and sum(sizes) == t.shape[axis]:
                return name, axis, sizes
    return None


def _steps(bound: dict, name: str, axis: int, sizes: list[int], extra: int = 0) -> dict:
    """The call cut (or lengthened, its last slice repeated) to PROBE_STEPS + `extra` loop steps."""
    want = PROBE_STEPS + extra
    steps = sizes[:want] + [sizes[-1]] * max(0, want - len(sizes))
    t = bound[name]
    length = sum(steps)
    if length <= t.shape[axis]:
        cut = t.narrow(axis, 0, length)
    else:
        last = t.narrow(axis, t.shape[axis] - sizes[-1], sizes[-1])
        cut = torch.cat([t] + [last] * ((length - t.shape[axis]) // sizes[-1]), dim=axis)
    return {**bound, name: cut}


def _differ(base: list[ChildCall], run: list[ChildCall], dynamic: dict) -> None:
    """The dims where a run's calls (the n-th call of each child against the base's n-th) differ, added
    to `dynamic`."""
    seen: dict = {}
    by_child: dict = {}
    for c in base:
        by_child.setdefault(c.child, []).append(c)
    for c in run:
        n = seen[c.child] = seen.get(c.child, -1) + 1
        others = by_child.get(c.child, [])
        if n >= len(others):
            continue
        mine, theirs = c.tensors(), others[n].tensors()
        for name, t in mine.items():
            o = theirs.get(name)
            if o is None or o.dim() != t.dim():
                continue
            axes = [a for a in range(t.dim()) if t.shape[a] != o.shape[a]]
            if axes:
                have = dynamic.setdefault(c.child, {}).setdefault(name, [])
                have[:] = sorted(set(have) | set(axes))


class StepCall(nn.Module):
    """One kind of a child's call as a module: its tensors in by name (`param`, a list's `param.i` as
    `param_i`: a file's input names), the child's output and each list's tensors after the call out."""

    def __init__(self, child: nn.Module, call: ChildCall):
        super().__init__()
        self.child, self.template = child, call.bound
        self.after = call.after

    def forward(self, **tensors):
        bound = {}
        for p, v in self.template.items():
            if isinstance(v, torch.Tensor):
                bound[p] = tensors[p]
            elif isinstance(v, list):
                bound[p] = [tensors[input_name(f"{p}.{i}")] if isinstance(e, torch.Tensor) else e
                            for i, e in enumerate(v)]
            else:
                bound[p] = v
        out = self.child(**bound)
        result = {OUT: out}
        for p in self.after:
            result.update({input_name(f"{p}.{i}") + NEXT: e for i, e in enumerate(bound[p])
                           if isinstance(e, torch.Tensor)})
        return result


def input_name(path: str) -> str:
    """A file's input name for a call's tensor: `feat_cache.5` -> `feat_cache_5`."""
    return path.replace(".", "_")


def after_values(call: ChildCall) -> dict:
    """{list parameter: [entry]} after the call, as the manifest keeps it: a tensor as its output's
    name {"tensor": name}, anything else its value (None, a marker string, an int)."""
    return {p: [{"tensor": input_name(f"{p}.{i}") + NEXT} if isinstance(e, torch.Tensor) else e
                for i, e in enumerate(v)] for p, v in call.after.items()}


class Stepped:
    """The slot of a method cut at its children, at load (module doc, 3.): `__call__` runs the library's
    method on the meta-device component with each exported child's forward a proxy over its files.
    `sessions`: {child: [(entry, session)]}: each step kind's manifest entry and its runner (a
    pipeline.runtime._Session: `.inputs`, `._run(feeds)`)."""

    def __init__(self, meta: nn.Module, slot: str, method: str, entry: dict, sessions: dict):
        self.meta, self.slot, self.method, self.entry, self.sessions = meta, slot, method, entry, sessions
        self.installed = False

    def install(self) -> None:
        if self.installed:
            return
        children = dict(self.meta.named_children())
        for name, kinds in self.sessions.items():
            child = children.get(name)
            if child is None:
                raise RuntimeError(f"{type(self.meta).__name__} has no child {name!r} for its exported steps: convert "
                                   "the pipeline again")
            object.__setattr__(child, "forward", _Proxy(name, inspect.signature(type(child).forward), kinds,
                                                        self.entry.get("dynamic", {}).get(name, {})))
        self.installed = True

    def __call__(self, component: str, method: str, bound: dict):
        bound.pop("generator", None)  # as a file's call (runtime._Session)
        self.install()
        with torch.no_grad():
            return getattr(type(self.meta), method)(self.meta, **bound)


class _Proxy:
    """A child's forward at load: the file of the call's kind, run; the lists written back."""

    def __init__(self, child: str, signature: inspect.Signature, kinds: list, dynamic: dict):
        self.child, self.signature, self.dynamic = child, signature, {child: dynamic}
        self.kinds = {e["key"]: (e, s) for e, s in kinds}

    def __call__(self, *args, **kwargs):
        bound = self.signature.bind(None, *args, **kwargs).arguments
        bound.pop(next(iter(self.signature.parameters)))
        call = ChildCall(self.child, bound)
        k = key(call, self.dynamic)
        if k not in self.kinds:
            raise RuntimeError(f"{self.child} called as {k[:200]}, a kind of call none of its exported steps takes "
                               f"(they take {len(self.kinds)} kinds): convert the pipeline with this call")
        entry, session = self.kinds[k]
        feeds = {}
        for name, t in call.tensors().items():
            want = session.inputs.get(input_name(name))
            t = t.detach().cpu()
            feeds[input_name(name)] = t.to(want) if want is not None and want != t.dtype else t
        result = manifest_mod.rebuild(entry["structure"], session._run(feeds))
        for p, values in entry["after"].items():
            bound[p][:] = [result[v["tensor"]] if isinstance(v, dict) else v for v in values]
        return result[OUT]
