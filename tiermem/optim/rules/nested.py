"""Per-parameter state the record keeps as several kinds, and in its memory order.

The generic path (generic.py) lays a parameter's state out from what the optimizer's
first step makes. A tensor with a dimension is one record kind. State kept as lists,
tuples or dicts of tensors (SOAP's and SPlus's per-side preconditioner matrices,
AggMo's momentum per beta), or as a tensor subclass made of plain tensors (torchao's
low-bit state: codes, block scales and a code map behind a float32 face), is several:
each plain tensor inside is a record kind of its own, named by its path ("GG[0]",
"momentum_buffer[0.9]", "exp_avg.codes"), and a template rebuilds the container around
the record's views for the shadow's step and for state_dict(). A record keeps a tensor's
bytes in the order the optimizer left them in memory (dim_order here, and
tiermem.partition.laid).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch
from torch import Tensor


def is_record_tensor(value: Any) -> bool:
    """State kept in the record: tensors with at least one dimension."""
    return isinstance(value, Tensor) and value.dim() > 0


# A template: ("leaf", kind) | ("list" | "tuple", (child, ...)) | ("dict", ((key, child), ...))
# | ("subclass", (cls, its __tensor_flatten__ context, size, stride, ((attr, child), ...)))
Template = tuple
CONTAINERS = {list: "list", tuple: "tuple", dict: "dict"}


class NotNested(Exception):
    """A value that cannot be a container of record tensors (says what is in the way)."""


def made_of_tensors(value: Any) -> bool:
    """A tensor subclass that says which plain tensors it is made of and is made again
    from them (__tensor_flatten__ / __tensor_unflatten__, the protocol torch.compile
    traces): torchao's OptimState8bit, OptimState4bit, OptimStateFp8."""
    cls = type(value)
    return (isinstance(value, Tensor) and cls not in (Tensor, torch.nn.Parameter)
            and callable(getattr(cls, "__tensor_flatten__", None))
            and callable(getattr(cls, "__tensor_unflatten__", None)))


def nests(value: Any) -> bool:
    """State the record keeps as several kinds: a container of tensors, or a tensor
    subclass made of plain ones."""
    return made_of_tensors(value) or (not isinstance(value, Tensor) and has_tensor(value))


def has_tensor(value: Any, depth: int = 0) -> bool:
    """Whether `value` is, or holds inside lists, tuples and dicts, a tensor."""
    if isinstance(value, Tensor):
        return True
    if depth >= 8 or type(value) not in CONTAINERS:
        return False
    items = value.values() if isinstance(value, dict) else value
    return any(has_tensor(v, depth + 1) for v in items)


def flatten(value: Any, name: str) -> tuple[Template, list[tuple[str, Tensor]]]:
    """A container of tensors as its template and its (kind, tensor) leaves, in order.
    Raises NotNested for a leaf that is no tensor with a dimension, or another container
    type (a deque: its length and maxlen are its state too)."""
    if made_of_tensors(value):
        names, context = value.__tensor_flatten__()
        children, leaves = [], []
        for attr in names:
            child, got = flatten(getattr(value, attr), f"{name}.{attr}")
            children.append((attr, child))
            leaves += got
        return ("subclass", (type(value), context, tuple(value.shape), tuple(value.stride()),
                             tuple(children))), leaves
    if isinstance(value, Tensor):
        if not is_record_tensor(value):
            raise NotNested(f"a 0-d tensor at {name}")
        return ("leaf", name), [(name, value)]
    kind = CONTAINERS.get(type(value))
    if kind is None:
        raise NotNested(f"a {type(value).__name__} at {name}")
    children, leaves = [], []
    pairs = value.items() if isinstance(value, dict) else enumerate(value)
    for key, v in pairs:
        child, got = flatten(v, f"{name}[{key!r}]")
        children.append((key, child) if isinstance(value, dict) else child)
        leaves += got
    return (kind, tuple(children)), leaves


def rebuild(template: Template, tensors: dict[str, Tensor]) -> Any:
    """The container `template` describes, around `tensors` (kind -> tensor)."""
    kind, body = template
    if kind == "leaf":
        return tensors[body]
    if kind == "subclass":
        cls, context, size, stride, children = body
        return cls.__tensor_unflatten__({attr: rebuild(child, tensors)
                                         for attr, child in children}, context, size, stride)
    if kind == "dict":
        return {key: rebuild(child, tensors) for key, child in body}
    items = [rebuild(child, tensors) for child in body]
    return items if kind == "list" else tuple(items)


def leaves_of(template: Template, value: Any) -> list[tuple[str, Any]] | None:
    """`value`'s (kind, leaf) pairs where it has the template's structure, else None."""
    kind, body = template
    if kind == "leaf":
        return [(body, value)]
    if kind == "subclass":
        cls, context, size, _, children = body
        if type(value) is not cls:
            return None
        names, now = value.__tensor_flatten__()
        if list(names) != [attr for attr, _ in children] or now != context or \
                tuple(value.shape) != size:
            return None
        pairs = [(child, getattr(value, attr)) for attr, child in children]
    elif CONTAINERS.get(type(value)) != kind or len(value) != len(body):
        return None
    elif kind == "dict":
        if [key for key, _ in body] != list(value.keys()):
            return None
        pairs = [(child, value[key]) for key, child in body]
    else:
        pairs = list(zip(body, value))
    out: list[tuple[str, Any]] = []
    for child, v in pairs:
        got = leaves_of(child, v)
        if got is None:
            return None
        out += got
    return out


def leaf_names(template: Template) -> list[str]:
    kind, body = template
    if kind == "leaf":
        return [body]
    if kind == "subclass":
        return [n for _, child in body[4] for n in leaf_names(child)]
    return [n for child in body for n in leaf_names(child[1] if kind == "dict" else child)]


def state_tensors(state: dict[str, Any]) -> dict[str, Tensor]:
    """One parameter's record tensors, those inside containers under their path names."""
    out: dict[str, Tensor] = {}
    for k, v in state.items():
        if nests(v):
            try:
                out.update(flatten(v, k)[1])
            except NotNested:
                pass  # the layout's probe refuses it, saying what it is
        elif is_record_tensor(v):
            out[k] = v
    return out


def structure(state: dict[str, Any]) -> dict[str, Any]:
    """What a record lays out of one parameter's state: each record tensor's shape and
    dtype, and each container's template."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if nests(v):
            try:
                template, leaves = flatten(v, k)
                out[k] = (template, [(tuple(t.shape), t.dtype) for _, t in leaves])
            except NotNested as exc:
                out[k] = str(exc)
        elif is_record_tensor(v):
            out[k] = (tuple(v.shape), v.dtype)
    return out


def dim_order(t: Tensor) -> tuple[int, ...] | None:
    """The order of `t`'s dims in memory, outermost first, where it is dense but not
    contiguous (SOAP's eigenbases from torch.linalg are column-major); None when it is
    contiguous (or not dense: a record holds it contiguous). Kept because matmul's
    rounding follows the memory order: handing the optimizer a contiguous copy of a
    column-major matrix changes its results in the last bits."""
    if t.dim() < 2 or t.is_contiguous():
        return None
    order = tuple(sorted(range(t.dim()), key=lambda d: -t.stride(d)))
    want, step = {}, 1
    for d in reversed(order):  # the strides a dense tensor laid out in this order has
        want[d] = step
        step *= t.shape[d]
    dense = all(want[d] == t.stride(d) for d in range(t.dim()) if t.shape[d] > 1)
    return order if dense else None


def value_digest(value: Any) -> str:
    """A digest of a value made of tensors (dtype, shape, bytes), containers and reprs."""
    h = hashlib.sha256()

    def feed(x: Any) -> None:
        if isinstance(x, Tensor):
            h.update(f"T{x.dtype}{tuple(x.shape)};".encode())
            h.update(x.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                     .numpy().tobytes())
        elif isinstance(x, dict):
            h.update(b"{")
            for k in sorted(x, key=repr):
                feed(k)
                feed(x[k])
            h.update(b"}")
        elif isinstance(x, (list, tuple)):
            h.update(f"{type(x).__name__}[".encode())
            for v in x:
                feed(v)
            h.update(b"]")
        else:
            h.update(f"{type(x).__name__}:{x!r};".encode())
    feed(value)
    return h.hexdigest()[:32]


def json_exact(value: Any, depth: int = 0) -> bool:
    """A host value a manifest keeps exactly (JSON turns tuples into lists and dict keys
    into strings): None, bools, numbers (NaN and infinities only where no list holds
    them), strings, and lists of them."""
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return depth == 0 or math.isfinite(value)
    return type(value) is list and depth < 8 and all(json_exact(v, depth + 1) for v in value)
