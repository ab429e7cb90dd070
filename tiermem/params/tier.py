"""ParamTier: the model's weights and gradients in the tiers, materialised module by module.

Units are the modules that own parameters directly (a parameter owned by two
modules, a tied embedding, belongs to the first and is fetched for both).
Leaf-owner granularity keeps the window small (a transformer block's weights
are fetched linear by linear) while a module's forward still sees all of its
own weights at once.

Between uses a parameter's storage is released (`p.data` becomes an empty
tensor) and its weights live in a record (records.py). A forward pre-hook
materialises the module's parameters into buffers of their own; the forward
post-hook unpins them, and they stay in the window until room is needed: then
the weight needed furthest ahead in the learned order (below) goes first, its
update this step counted as a use (least recently used first before the order is
learned). Autograd's saved tensors never hold a
window buffer: a saved tensor that views a managed weight is packed as
(parameter, geometry) and unpacked by materialising the parameter again,
on demand if it was evicted, so backward always sees the right weights
whatever the window holds.

User code never sees a released weight on the thread that opened the block: a torch
function mode (UseGuard) pushed there for the block's length materialises one handed
to any torch call (in the model's forward or between steps), answers its shape from
the record, and marks a weight whose p.data is taken as changed (a change through
p.data moves no version counter), so that it is written back before its release.

The order units are needed in (forward pre-hooks and backward unpacks) is
recorded on the first iteration; afterwards each request is checked against it
and the next `parameters.prefetch` units are read ahead. A unit out of the
learned order is fetched on demand (and counted): never run with a stale or
missing weight.

Gradients leave memory as they become final (post-accumulate-grad hooks) into
their records, added to the stored one when the record already holds a
gradient since the last step (torch's own accumulation), and the squared norm of
the stored value is kept, so `clip_grad_norm_` needs no pass over the grads. The
optimizer step opens the parameters of one partition at a time
(`open_for_update`): weights materialised, the gradient read back and scaled by
the clip coefficient; a parameter's updated weights are written back as its last
piece is updated (from their buffer, no copy; they stay in the window), or when
evicted or the step ends if they changed otherwise.

A model on a device (CUDA parameters, or CPU ones with the emulated streams) keeps its
records on the host or NVMe tier as well; materialised weights are device buffers filled
through pinned host buffers, and gradients come back through pinned staging: the stream
story of one weight and one gradient is in device.py. The window then bounds the device
bytes of materialised weights (released ones count until the kernels that read them ran).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import mmap
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

import torch
from torch.overrides import TorchFunctionMode

from tiermem.config import ConfigError, Settings
from tiermem.device.lanes import CudaBackend, DeferredBackend
from tiermem.errors import TierMemError, WeightsLost
from tiermem.params.compiled import register, traced_use, untraced, unregister
from tiermem.params.device import DeviceSide
from tiermem.params.records import GRAD, WEIGHT, Fetch, Meta, Records
from tiermem.sizes import format_size
from tiermem.sysinfo import available_memory


MAX_ORDER = 1 << 20  # unit requests recorded before the first step; more are not learned

F = TypeVar("F", bound=Callable[..., Any])


def _locked(fn: F) -> F:
    """Run under the tier's lock: with pipeline.overlap_backward the optimizer's worker
    opens partitions for their update while backward (autograd's thread) fetches weights
    and stores gradients; the window, the records and their I/O engine are one thread's
    at a time.

    Outside inference mode too: a forward under torch.inference_mode() (an evaluation
    between steps) would otherwise make the window's buffers, the weights installed in
    p.data and the placeholders of released ones inference tensors, which the next
    training forward cannot save for backward and the step cannot update in place."""
    @functools.wraps(fn)
    def run(self: "ParamTier", *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            if torch.is_inference_mode_enabled():
                # (leaving inference mode turns grad mode on: kept as the caller had it)
                grad = torch.is_grad_enabled()
                with torch.inference_mode(False), torch.set_grad_enabled(grad):
                    return fn(self, *args, **kwargs)
            return fn(self, *args, **kwargs)
    return run  # type: ignore[return-value]


def _no_saved_hooks() -> bool:
    """No saved-tensor hooks are active on this thread (and they may be pushed). torch
    has no public query for it; without this one, never push."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
    if top is None or enabled is None:
        return False
    return enabled() and top(False) is None


@dataclass(frozen=True)
class Saved:
    """A tensor autograd saved that views a managed weight, by geometry instead of storage."""

    index: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int  # elements after the parameter's own storage offset
    version: int  # ParamTier.steps when saved


@dataclass
class ParamStats:
    """Counters since the block opened."""

    fetches: int = 0  # weight records brought into the window
    prefetched: int = 0  # of those, read ahead in the learned order
    on_demand: int = 0  # needed at once: not read ahead (first iteration, out of order)
    out_of_order: int = 0  # units requested against the learned order
    outside_hooks: int = 0  # weights used by a forward other than their module's own
    outside_forward: int = 0  # released weights read by code outside the model's forward
    data_taken: int = 0  # p.data taken of a weight: written back before its release
    evictions: int = 0
    grads_stored: int = 0
    grads_held: int = 0  # of those, kept in memory for an update during backward
    grads_spilled: int = 0  # held ones the window needed the room of: written after all
    peak_window_bytes: int = 0
    h2d_bytes: int = 0  # a device model's weights copied to the device
    d2h_bytes: int = 0  # a device model's gradients copied back
    peak_device_bytes: int = 0  # a device model's weights in device memory at most

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


_T = torch.Tensor


def _getters(*names: str) -> set[Any]:
    return {getattr(_T, n).__get__ for n in names if hasattr(_T, n)}


def _methods(*names: str) -> set[Any]:
    return {getattr(_T, n) for n in names if hasattr(_T, n)}


# What a released parameter answers from its record's shape, without reading the weights:
# a parameter count or a shape logged between steps is the model's, not the (0,) of the
# empty tensor the tier leaves in p.data.
_SHAPED = _getters("shape", "ndim", "nbytes") | _methods(
    "size", "numel", "nelement", "dim", "ndimension", "__len__")
# Reads that need neither the weights nor their shape: a released parameter stays released
# (the optimizer's, autograd's and the modules' bookkeeping touch these on every parameter).
_NO_VALUES = _getters(
    "grad", "_grad", "requires_grad", "dtype", "device", "is_leaf", "_version", "grad_fn",
    "_grad_fn", "layout", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized",
    "is_mkldnn", "is_nested", "is_xpu", "is_mps", "name", "itemsize", "retains_grad",
    "_backward_hooks", "_post_accumulate_grad_hooks", "output_nr") | _methods(
    "requires_grad_", "register_hook", "register_post_accumulate_grad_hook",
    "is_floating_point", "is_complex", "element_size", "get_device", "retain_grad",
    "is_inference", "new_zeros", "new_ones", "new_empty", "new_full") | {
    torch._has_compatible_shallow_copy_type}  # (Module._apply's)
_DATA = _T.data.__get__
_GRAD_SET = _T.grad.__set__
# New tensors of a parameter's shape, dtype and device, which read none of its values
# (torch.distributed.checkpoint's helpers and EMA shadows make zeros_like(p) of every one)
_LIKE = {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like,
         torch.rand_like, torch.randn_like, torch.randint_like}
# Conversions that give the tensor itself when it has the dtype, device and layout asked
# for: model.to(its device), .float() of an fp32 model (Lightning moves the model to its
# device again) are tried on the empty placeholder first, and read no weights when that
# comes back as itself
_SELF_IF_SAME = _methods("to", "cpu", "cuda", "float", "double", "half", "bfloat16",
                         "contiguous")
# Module.state_dict() detaches every parameter before the tier's post-hook puts the current
# weights in its place (fetched one by one): materialising them there read each twice
_SAVE_CODE = torch.nn.Module._save_to_state_dict.__code__


def _tiers_own(frame: Any) -> bool:
    """The torch call being guarded comes from tiermem's own code (through torch's Python
    layers, as the optimizer's kernels), which sees parameters as the tier left them, or
    from Module._save_to_state_dict, whose copies the state-dict hook replaces."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("tiermem."):
            return True
        if frame.f_code is _SAVE_CODE:
            return True
        if not name.startswith("torch"):
            return False
        frame = frame.f_back
    return False


def _untouched(meta: Meta) -> torch.Tensor:
    """A contiguous CPU tensor of `meta`'s shape and dtype whose pages are never touched
    (an anonymous mapping: no memory is used until written), for code that reads only what
    a tensor is (shape, dtype, device, strides) and may be given more than the window."""
    pages = mmap.mmap(-1, max(meta.nbytes, 1))
    return torch.frombuffer(pages, dtype=meta.dtype,
                            count=meta.shape.numel()).view(meta.shape)


class UseGuard(TorchFunctionMode):
    """No torch function ever sees a released weight. Pushed on the thread that opened the
    block for its whole length (or, on another thread, for the length of a forward):
    during the model's forward a released weight handed to any torch function (a module's
    weight used from another module's forward, not through its own call) is materialised
    first, on demand; outside it (logging, metrics, an init, an EMA helper between steps)
    a read of one is materialised too, pinned for the call, and its shape is answered
    from the record without a read. A `p.data` taken of a weight marks it changed (an edit
    through it moves no version counter), so that it is written back before release."""

    def __init__(self, tier: "ParamTier") -> None:
        super().__init__()
        self.tier: ParamTier | None = tier

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        tier = self.tier
        kwargs = kwargs or {}
        if tier is None or tier._busy:
            return func(*args, **kwargs)
        found: list[torch.nn.Parameter] | None = None
        for a in ((*args, *kwargs.values()) if kwargs else args):
            if type(a) is torch.nn.Parameter:
                found = [a] if found is None else [*found, a]
            elif type(a) in (list, tuple):
                for b in a:
                    if type(b) is torch.nn.Parameter:
                        found = [b] if found is None else [*found, b]
        if found is None:
            return func(*args, **kwargs)
        if torch.compiler.is_compiling():
            return _traced_use(tier, func, args, kwargs, found)
        return tier._guarded(func, args, kwargs, found, sys._getframe(1))


def _traced_use(tier: "ParamTier", func: Any, args: Any, kwargs: Any,
                found: list[torch.nn.Parameter]) -> Any:
    """A torch call given parameters, in code torch.compile traces (UseGuard's, run at
    trace time). The tier's hooks are graph breaks (compiled.untraced), so no tier code runs
    inside a compiled graph, and dynamo guards each graph on its inputs' shapes and devices
    at its entry: a weight materialised when the graph is traced is one when it runs (a
    released one is refused when dynamo first reads it: compiled.py). Such a use is traced
    as it is; `p.data` taken (which marks the weight changed) leaves the graph, and runs
    eagerly through the guard, as without compile (and so would a released weight)."""
    traced_use()
    if func == _DATA or any(p.numel() == 0 for p in found):
        return tier._guarded(func, args, kwargs, found, None)  # (untraced: a graph break)
    return func(*args, **kwargs)


class Uploaded:
    """A read ahead already on its way to the device (a device model): wait() gives the
    device buffer, which the compute stream waits for before use like any other."""

    buf = None

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def landed(self) -> bool:
        return True

    def wait(self) -> torch.Tensor:
        return self.value


class _Restore:
    """A handle whose remove() puts an instance attribute back as it was."""

    def __init__(self, obj: Any, name: str, had: Any) -> None:
        self.obj, self.name, self.had = obj, name, had

    def remove(self) -> None:
        if self.had is None:
            self.obj.__dict__.pop(self.name, None)
        else:
            setattr(self.obj, self.name, self.had)


class ParamTier:
    """Weights and gradients of `model` on `settings.parameters.offload` (host or nvme)."""

    def __init__(self, model: torch.nn.Module, settings: Settings, *, swap_name: str,
                 resume: bool = False,
                 streams: CudaBackend | DeferredBackend | None = None) -> None:
        """resume: a crash-consistent run is resumed; the weight and gradient records a
        crashed run left are working copies (the commit holds the weights), dropped.
        streams: the stream backend of a device model (None: CUDA streams for CUDA
        parameters; DeferredBackend() makes CPU parameters take the device path)."""
        ps = settings.parameters
        if ps.offload == "none":
            raise TierMemError("parameters.offload is none: there is no parameter tier to make")
        self.model = model
        self.settings = settings
        self.prefetch = ps.prefetch
        # Bytes the reads ahead keep in flight at least (past `prefetch` units when those
        # are small): a unit is often one linear of a few MiB, and two of them leave most
        # of the I/O queue idle while the layer computes. Half the window at most, so the
        # units in use keep their room.
        self.ahead_bytes = min(settings.io.queue_depth * settings.io.block_size,
                               ps.window // 2)
        self.window = ps.window
        self.params: list[torch.nn.Parameter] = list(model.parameters())
        self.index = {id(p): i for i, p in enumerate(self.params)}
        names: dict[int, str] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), n)
        self.names = [names[id(p)] for p in self.params]
        cuda = sorted({str(p.device) for p in self.params if p.device.type == "cuda"})
        if len(cuda) > 1:
            raise TierMemError(f"parameters.offload: the model's parameters live on several "
                               f"devices ({', '.join(cuda)}); the parameter tier serves one")
        if streams is None and cuda:
            streams = CudaBackend(torch.device(cuda[0]))
        # where materialised weights live: the CPU, or the device of `streams`
        self.device = streams.device if streams is not None else torch.device("cpu")
        for i, p in enumerate(self.params):
            if p.device.type not in ("cpu", "meta") and p.device != self.device:
                raise TierMemError(f"parameters.offload: parameter {self.names[i]} is on "
                                   f"{p.device}, the streams serve {self.device}")
            if not p.is_floating_point() or not p.is_contiguous() or p.numel() == 0:
                raise TierMemError(f"parameters.offload: parameter {self.names[i]} "
                                   f"({p.dtype}, shape {tuple(p.shape)}) must be a non-empty "
                                   "contiguous floating-point tensor")
        # units: modules owning parameters directly, with the indices they use
        self.units: list[tuple[int, ...]] = []
        self.unit_names: list[str] = []
        self.unit_of: list[int] = [-1] * len(self.params)
        self._unit_modules: list[torch.nn.Module] = []
        for mname, m in model.named_modules(remove_duplicate=True):
            own = []
            for p in m._parameters.values():
                if p is not None and id(p) in self.index and self.index[id(p)] not in own:
                    own.append(self.index[id(p)])
            if not own:
                continue
            u = len(self.units)
            self.units.append(tuple(own))
            self.unit_names.append(mname or "<root>")
            self._unit_modules.append(m)
            for i in own:
                if self.unit_of[i] < 0:
                    self.unit_of[i] = u
        self.records = Records([Meta(p.shape, p.dtype) for p in self.params], ps.offload,
                               settings, swap_name + ".params", drop_stale=resume,
                               pinned=streams is not None and not streams.host_is_device)
        self.records.pending_limit = self.window
        self.records.recycler.limit = 2 * self.window  # the window and its writes in flight
        # the window: materialised weights (LRU order), reads in flight, pins, grads out
        self.live: OrderedDict[int, int] = OrderedDict()  # index -> bytes held
        self.bufs: dict[int, torch.Tensor] = {}  # index -> the fetch buffer it lives in
        self.inflight: dict[int, Fetch] = {}
        self.pins: dict[int, int] = {}
        self.dirty: set[int] = set()
        # p._version of each materialised weight when it last matched its record (or was
        # marked dirty): an in-place change through the parameter since (Lightning's
        # StochasticWeightAveraging copies the averaged weights in with
        # p.detach().copy_()) makes it dirty too, where it was lost at the release or
        # the exit that gave the model its records back (_note_edit)
        self.versions: dict[int, int] = {}
        # Weights changed by someone other than the optimizer's update (an edit in place,
        # p.data taken, new weights assigned, model.load_state_dict()) and not updated by a
        # step since: a crash-consistent commit copies them into their records' masters
        # (take_edited), or a resume puts back the weights of before the change
        self.edited: set[int] = set()
        # The same, kept until the optimizer takes them (take_pending_edits, as a step
        # begins) rather than until the next commit: the update of a low-precision weight
        # starts from its master, which takes the change first
        self.edits_pending: set[int] = set()
        # (p._version, device) of each released parameter as the release left it: a change
        # since went to its empty placeholder, not to the weights (_check_param)
        self.released: dict[int, tuple[int, torch.device]] = {}
        self.grads_out: dict[int, int] = {}  # index -> bytes of a gradient handed to the step
        self.grads_inflight: dict[int, Fetch] = {}  # gradients read ahead for the step
        # Gradients kept in memory as backward left them, never written to their record
        # (keep_grads: the update runs during backward and takes them from here); counted
        # in `used`, spilled to the record when the window needs the room.
        self.keep_grads = False
        self.held: dict[int, torch.Tensor] = {}
        self.opened: set[int] = set()  # parameters an update of this step has opened
        # gradients handed to the step from `held`: in no record, so written if evicted
        # before every partition holding a piece of the parameter has been updated
        self.unwritten: set[int] = set()
        # gradients of `unwritten` whose every piece was updated: gone with the step (no
        # record was ever written), so a step that failed after them cannot read them again
        self.spent: set[int] = set()
        self.pieces = [1] * len(self.params)  # optimizer partitions holding a piece of each
        # the parameters the optimizer holds (None: every one), whose gradients a step
        # consumes; another keeps its gradient across steps, as its p.grad would in torch,
        # for an add_param_group to hand to the step after it (optimizer_holds)
        self.optimized: set[int] | None = None
        self.updates: dict[int, int] = {}  # pieces updated this step
        self.grad_edits = 0  # zero_grad and clip calls: a gradient edited after its hook
        self.grad_stores = [0] * len(self.params)  # gradients stored (a backward's, each)
        self.lock = threading.RLock()
        # Partitions queued for an update during backward and not updated yet (set by the
        # optimizer's overlap): while there are some, a gradient with no room waits for
        # them to free it rather than pushing out weights backward needs or spilling.
        self.backlog = 0
        self.room = threading.Condition(self.lock)
        self.finished: set[int] = set()  # every piece updated this step: first out
        self.arriving: set[int] = set()  # weights read by a thread waiting outside the lock
        self.used = 0
        self._by_storage: dict[int, int] = {}  # data_ptr of a materialised weight -> index
        # the learned order of unit requests
        self.learned: list[int] | None = None
        self._recording: list[int] = []
        self._cursor = 0
        # per parameter, the positions in `learned` of the units that use it (eviction by
        # next use)
        self._uses: list[list[int]] = []
        self.step_order: dict[int, int] = {}  # index -> rank in the step's order (no overlap)
        # gradients
        self.has_grad = [False] * len(self.params)
        # What torch's p.grad would hold where the tier holds no gradient. zeroed: a tensor
        # of zeros (zero_grad(set_to_none=False) after a gradient): the step updates the
        # parameter with it and a backward adds into it, so it is stored, as zeros, only
        # when something reads it (_fill_zeroed), not at every zero_grad. stale: the
        # gradient the last step consumed, no zero_grad since: torch would add the next
        # backward into it, or step with it again; the tier has dropped it, so both are
        # refused (_refuse_stale).
        self.zeroed: set[int] = set()
        self.stale: set[int] = set()
        self.norms: dict[int, torch.Tensor] = {}
        self.clip_coef: torch.Tensor | None = None
        self.steps = 0
        self.stats = ParamStats()
        # a device model: streams, pinned staging, device buffers (device.py)
        self.dev = DeviceSide(streams, staging_limit=self.window, stats=self.stats) \
            if streams is not None else None
        self.on_device: set[int] = set()  # materialised weights that are device buffers
        self.to_device: set[int] = set()  # reads ahead bound for the device
        self._landing_queued = False  # the end-of-backward callback lands the gradients
        self._stepping = False  # the step's host materialisation began (a device model)
        self._handles: list[Any] = []
        self._accumulators: dict[int, Any] = {}  # index -> its gradient node, hooked
        self._grad_hooked: set[int] = set()  # parameters whose gradients come to the tier
        # a device model's parameters given host weights since their node was made
        self._rehook: set[int] = set()
        self._hooks_ctx: list[Any] = []
        # per entry of _hooks_ctx, the unit whose forward pushed it, with how many of its
        # forwards were running then (a unit may run inside itself); None: the model's
        self._hooks_unit: list[tuple[int, int] | None] = []
        self._running = [0] * len(self.units)  # forwards of each unit under way
        self._closed = False
        self._busy = False  # inside the tier's own work: UseGuard stands aside
        # the guard of the block's thread (UseGuard), pushed once set up
        self._guard: UseGuard | None = None
        self._guard_thread = threading.get_ident()
        self._metas: dict[int, torch.Tensor] = {}  # _meta's, by index
        taken: dict[int, torch.Tensor] = {}  # the gradients p.grad held at entry
        try:
            self._check_window()
            self._install()
            for u in range(len(self.units)):  # module by module: bounded memory
                self._materialise_meta(u)
                for i in self.units[u]:
                    if self.unit_of[i] == u:
                        self._take_in(i)
            # A gradient from a backward before the block (or one zero_grad(set_to_none=
            # False) left) is one torch's next step would use or add to: it moves into the
            # tier like any other, rather than staying in p.grad, where neither the step
            # nor the next backward's hook would see it.
            for i, p in enumerate(self.params):
                if p.grad is not None:
                    taken[i], p.grad = p.grad, None
                    self.store_gradient(p, taken[i].detach().to("cpu"))
            self.records.drain()
            self._guard = UseGuard(self)
            self._guard.__enter__()
            register(self)  # (released weights kept out of what torch.compile traces)
        except BaseException:
            self._accumulators.clear()
            self.records.drain()
            for i, p in enumerate(self.params):  # whatever was released comes back
                if p.numel() == 0 and i not in self.live:
                    try:
                        p.data = self.records.fetch(WEIGHT, i).wait().to(self.device,
                                                                         copy=True)
                    except TierMemError:
                        pass
                if i in taken and p.grad is None and p.shape == taken[i].shape:
                    p.grad = taken[i]
            for h in self._handles:
                h.remove()
            if self.dev is not None:
                self.dev.close()
            self.records.close()
            raise

    def check_partitions(self, partitions: Iterable[Iterable[torch.Tensor]]) -> None:
        """Refuse an optimizer parameter that is not the model's (its weights would not be
        in the tier), and a partition whose parameters' weights and gradients (opened
        together for its update) do not fit in the window; with keep_grads (the update
        runs during backward) next to the largest module's weights, which backward may
        hold at the same time."""
        unit = max((sum(self._bytes(i) for i in own) for own in self.units), default=0) \
            if self.keep_grads else 0
        for n, params in enumerate(partitions):
            idx = self.indices(params)
            need = sum(2 * self._bytes(i) for i in idx) + unit
            if need > self.window:
                also = (" and, the update running during backward "
                        "(pipeline.overlap_backward), the largest module's weights"
                        if unit else "")
                raise ConfigError(
                    "parameters.window", self.window,
                    f"must hold the weights and gradients of one optimizer partition, opened "
                    f"together for its update{also}: partition {n} ({self.names[idx[0]]}, "
                    f"...) needs {format_size(need)}; raise it or lower "
                    "pipeline.partition_size")

    # -- set-up -------------------------------------------------------------------

    def _bytes(self, i: int) -> int:
        return self.records.slot_bytes(i)

    def _check_window(self) -> None:
        need, worst = 0, None
        for u, own in enumerate(self.units):
            b = sum(self._bytes(i) for i in own)
            if b > need:
                need, worst = b, u
        if need > self.window:
            raise ConfigError(
                "parameters.window", self.window,
                f"must hold the largest module's weights: {self.unit_names[worst]} needs "
                f"{format_size(need)} ({format_size(need - self.window)} more); raise it or "
                "split that module")

    def _install(self) -> None:
        for u, m in enumerate(self._unit_modules):
            self._handles.append(m.register_forward_pre_hook(
                untraced(lambda mod, args, u=u: self._enter(u))))
            self._handles.append(m.register_forward_hook(
                untraced(lambda mod, args, out, u=u: self._leave(u)), always_call=True))
            self._handles.append(m.register_state_dict_post_hook(
                lambda mod, sd, prefix, meta, u=u: self._fill_state_dict(u, sd, prefix)))
            self._handles.append(m.register_load_state_dict_pre_hook(
                lambda mod, *args, u=u: self._enter_load(u)))
            self._handles.append(m.register_load_state_dict_post_hook(
                lambda mod, keys, u=u: self._leave_load(u)))
        # the root brackets a forward with the saved-tensor hooks
        self._handles.append(self.model.register_forward_pre_hook(
            untraced(self._push_saved_hooks), prepend=True))
        self._handles.append(self.model.register_forward_hook(
            untraced(lambda mod, args, out: self._pop_saved_hooks()), always_call=True))
        model, tier = self.model, self
        had = model.__dict__.get("zero_grad")

        def zero_grad(set_to_none: bool = True) -> None:
            tier.zero_grad(set_to_none=set_to_none)
            (had or type(model).zero_grad.__get__(model))(set_to_none)

        model.zero_grad = zero_grad
        self._handles.append(_Restore(model, "zero_grad", had))

        def no_copy(memo: dict, name: str) -> None:
            raise TierMemError(
                f"copy.deepcopy reached {name} inside the tiermem.offload block: its weights "
                "are in the parameter tier (parameters.offload), so the copy would hold the "
                "empty tensors left in p.data between uses, and the tier's hooks. Copy the "
                "model before the block (AveragedModel(model) too), or load a copy made "
                "outside it with model.state_dict()")

        # A deep copy reaching the root or any unit (a parent's copies its children) is
        # refused: it failed on the tier's own objects in the root's hooks, and a unit's
        # copy had empty weights and hooks that fetched the original's
        for m, name in [(model, "the model"), *((m, self.unit_names[u]) for u, m in
                                               enumerate(self._unit_modules))]:
            if "__deepcopy__" in m.__dict__:
                continue
            m.__deepcopy__ = functools.partial(no_copy, name=name)
            self._handles.append(_Restore(m, "__deepcopy__", None))

    def _take_in(self, i: int) -> None:
        """Parameter `i`'s weights (on the CPU now) into their record; its gradient hooks;
        then its storage released."""
        p = self.params[i]
        self.records.write(WEIGHT, i, p.detach())
        if self.dev is not None and p.device != self.device:
            # a CPU-made (meta) parameter of a device model: the gradient node made below
            # records the device its gradients come on
            p.data = p.data.to(self.device)
        if p.requires_grad:
            self._hook_grad(i)
        self._release_storage(i)

    def _hook_grad(self, i: int) -> None:
        """Parameter `i`'s gradients come to the tier from now on. Its weights must be in
        p.data, where it trains: AccumulateGrad lays a gradient out like its parameter (a
        transposed one is copied into the parameter's strides), and the node records the
        parameter's shape and device when made, so it is made now. It is held so that the
        same node (and its hook) serves every backward."""
        self._hook_accumulator(i)
        self._handles.append(self.params[i].register_post_accumulate_grad_hook(
            untraced(self._grad_ready)))
        self._grad_hooked.add(i)

    def _unhooked(self, indices: Iterable[int]) -> list[int]:
        """Of `indices`, the parameters that require a gradient the tier takes none of yet:
        frozen when the block opened, unfrozen since."""
        return [i for i in indices
                if i not in self._grad_hooked and self.params[i].requires_grad]

    def _hook_unfrozen(self, indices: Iterable[int]) -> None:
        """Parameters unfrozen since the block opened, whose weights are in place now (a
        forward, a read between steps), hooked before autograd can make their gradient
        node without the tier's hooks: their gradients would stay in p.grad, where
        neither the step nor clip_grad_norm_ looks."""
        for i in self._unhooked(indices):
            if self._ready(i):
                self._hook_grad(i)

    def _hook_accumulator(self, i: int) -> None:
        """Parameter i's gradient node (made now if autograd has none: its weights must be
        in place, on the device it trains on) with the hook that materialises them first."""
        p = self.params[i]
        with torch.enable_grad():
            node = p.view_as(p).grad_fn.next_functions[0][0]
        if node is self._accumulators.get(i):
            return
        self._accumulators[i] = node
        self._handles.append(node.register_prehook(
            untraced(lambda grads, i=i: self._before_accumulate(i))))

    def _on_device_again(self, i: int) -> None:
        """Parameter i of a device model has its device weights back after host ones (the
        step's): autograd dropped its gradient node when p.data changed device (torch's
        set_data), and the next backward would make one without the hook; made here."""
        # under inference_mode no node can be made: the next use outside it makes it
        if i in self._rehook and not torch.is_inference_mode_enabled():
            self._rehook.discard(i)
            if self.params[i].requires_grad:
                self._hook_accumulator(i)

    def _materialise_meta(self, u: int) -> None:
        """A module built on the meta device: its own parameters made on the CPU and
        initialised by its reset_parameters(), one module at a time, so that the whole model
        is never in memory."""
        m = self._unit_modules[u]
        mine = [i for i in self.units[u] if self.unit_of[i] == u and self.params[i].is_meta]
        if not mine:
            return
        reset = getattr(m, "reset_parameters", None)
        if reset is None:
            raise TierMemError(
                f"parameters.offload: {self.unit_names[u]} ({type(m).__name__}) has parameters "
                "on the meta device and no reset_parameters() to initialise them")
        if any(self.params[i].is_meta for i in self.units[u] if i not in mine):
            raise TierMemError(f"parameters.offload: {self.unit_names[u]} shares a parameter "
                               "still on the meta device with a module not initialised yet")
        for i in mine:
            p = self.params[i]
            # p.data cannot change a meta tensor into a CPU one; swap_tensors keeps the
            # Parameter object (the optimizer's, a tied module's) and changes what it is.
            torch.utils.swap_tensors(p, torch.nn.Parameter(
                torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad))
        with torch.no_grad():
            reset()

    def _guarding_here(self) -> bool:
        return self._guard is not None and threading.get_ident() == self._guard_thread

    def _push_saved_hooks(self, mod: Any, args: Any, *,
                          unit: tuple[int, int] | None = None) -> None:
        ctxs: tuple[Any, ...] = (torch.autograd.graph.saved_tensors_hooks(
            untraced(self._pack), untraced(self._unpack)),)
        if not self._guarding_here():  # a forward on another thread than the block's
            ctxs += (UseGuard(self),)
        for c in ctxs:
            c.__enter__()
        self._hooks_ctx.append(ctxs)
        self._hooks_unit.append(unit)

    def _pop_saved_hooks(self) -> None:
        if self._hooks_ctx:
            self._hooks_unit.pop()
            for c in reversed(self._hooks_ctx.pop()):
                c.__exit__(None, None, None)

    # -- the window ---------------------------------------------------------------

    def _release_storage(self, i: int) -> None:
        p = self.params[i]
        self._by_storage.pop(p.untyped_storage().data_ptr(), None)
        self.bufs.pop(i, None)
        if i in self.on_device:
            self.on_device.discard(i)
            self.dev.release(i, p.data)  # freed once the kernels queued to read it ran
        # a device model's parameters stay on its device when empty (p.device is right)
        p.data = torch.empty(0, dtype=self.records.metas[i].dtype,
                             device=self.device if self.dev is not None else p.device)
        self.released[i] = (p._version, p.device)

    def _check_param(self, i: int) -> bool:
        """Parameter `i` as the tier left it, or changed only in ways that can be kept.
        Code outside the model's forward (an init, a weight average, a conversion) sees a
        released parameter as the empty tensor the tier left in p.data: an in-place change
        of it changes nothing, and a dtype or device it is given would be silently undone
        by the next materialisation. Both are refused (_refuse_changes). New weights of the
        parameter's shape, dtype and device assigned to p.data (not counted by p._version)
        are kept: a live parameter's become its window copy, written back before they are
        released; True for a released one's, which the caller installs (_adopt)."""
        kind = self._change(i)
        if kind is None:
            return False
        if kind == "assigned":
            self._own_storage(i)
            if i not in self.live:
                return True
            p = self.params[i]
            self.bufs.pop(i, None)
            self._by_storage[p.untyped_storage().data_ptr()] = i
            self.dirty.add(i)
            self._mark_edited(i)
            self.versions[i] = p._version
            return False
        self._refuse_changes()
        return False  # (not reached)

    def _own_storage(self, i: int) -> None:
        """New weights assigned to parameter `i` that are a piece of a larger storage (the
        views of one vector torch's vector_to_parameters gives every parameter) are copied
        into one of their own: the tier finds a weight by its storage (saved tensors,
        write-backs), and several parameters over one storage were taken for each other
        (backward rebuilt a saved weight at another's offset)."""
        p = self.params[i]
        if p.storage_offset() or p.untyped_storage().nbytes() != p.numel() * p.element_size():
            p.data = p.data.clone()

    def _change(self, i: int) -> str | None:
        """How parameter `i` was changed behind the tier: None (it was not, or only
        through a live parameter's own in-place ops, which _note_edit keeps), "assigned"
        (new weights of its shape, dtype and device in p.data: kept on a host model; a
        device buffer is written by kernels queued on the model's streams), "in place"
        (a released one's placeholder changed in place: lost) or "converted" (another
        dtype, shape or device, or new data on a device model)."""
        p, m = self.params[i], self.records.metas[i]
        if i in self.live:
            if self._by_storage.get(p.untyped_storage().data_ptr()) == i:
                return None
            same = p.shape == m.shape and p.device == self.device
        else:
            version, device = self.released.get(i, (p._version, p.device))
            if p.numel() == 0 and p.dtype == m.dtype and p.device == device:
                return None if p._version == version else "in place"
            same = p.shape == m.shape and p.device == device
        # (contiguous: autograd's saved views of it are rebuilt with their strides on the
        # record's contiguous copy once it is evicted)
        return ("assigned" if same and p.dtype == m.dtype and p.is_contiguous()
                and self.dev is None else "converted")

    def _refuse_changes(self) -> None:
        """Every parameter changed in a way _check_param cannot keep goes back to its
        record's weights (released; a live one in use now stays), and one error names them: the
        block can go on, or be left, with the weights it had."""
        lost, converted = [], []
        for i, p in enumerate(self.params):
            kind = self._change(i)
            if kind not in ("in place", "converted"):
                continue
            (lost if kind == "in place" else converted).append(i)
            if kind == "converted" and not converted[1:]:
                what = (f"{p.dtype}, shape {tuple(p.shape)}, on {p.device}"
                        f"{'' if p.is_contiguous() else ', not contiguous'}")
            if i in self.live:
                if self.pins.get(i):
                    continue
                self.dirty.discard(i)
                self.on_device.discard(i)
                self.used -= self.live.pop(i)
            self.bufs.pop(i, None)
            p.data = torch.empty(0, dtype=self.records.metas[i].dtype, device=self.device)
            self.released[i] = (p._version, p.device)

        def named(idx: list[int]) -> str:
            return (", ".join(self.names[i] for i in idx[:4])
                    + (f" and {len(idx) - 4} more" if len(idx) > 4 else ""))

        if converted:
            m = self.records.metas[converted[0]]
            verb = "was" if len(converted) == 1 else "were"
            raise TierMemError(
                f"parameters.offload: {named(converted)} {verb} given new data inside the block "
                f"({what}: p.data assigned, or module.to(), .half(), .cuda()); the parameter "
                f"tier holds {self.names[converted[0]]} as {m.dtype}, shape {tuple(m.shape)}"
                f"{'' if self.dev is None else f', on {self.device}'}, and keeps new weights "
                "assigned to p.data only in those, contiguous (on a model on the CPU). Convert "
                "or move the model before tiermem.offload, or load new weights with "
                "model.load_state_dict(); the parameters have their weights from before")
        raise TierMemError(
            f"parameters.offload: {named(lost)} {'was' if len(lost) == 1 else 'were'} changed "
            "in place while the weights were out of memory: between uses the parameter tier "
            "leaves an empty tensor in p.data, so an in-place change outside the model's "
            "forward (torch.nn.init, p.mul_() or p.copy_() under torch.no_grad(), a weight "
            "average written into the model) reached no weights and is lost; the weights "
            "from before are kept. Change weights inside the block with "
            "model.load_state_dict() (written to the tier), or before tiermem.offload")

    def _install_weight(self, i: int, value: torch.Tensor, buf: torch.Tensor | None) -> None:
        p = self.params[i]
        p.data = value
        self.versions[i] = p._version
        self._by_storage[value.untyped_storage().data_ptr()] = i
        if buf is not None:
            self.bufs[i] = buf
        self.live[i] = self._bytes(i)

    def _to_device(self, i: int) -> None:
        """Parameter i's host weights (materialised for the step, a check, a load) to a
        device buffer, without a read: its record written first if they changed, so a
        device copy never holds the only changed weights."""
        self._note_edit(i)
        if i in self.dirty:
            self._write_back(i)  # reads the buffer only: the upload below may read it too
            self.dirty.discard(i)
        p = self.params[i]
        value = p.detach()
        keep = self.bufs.pop(i, None)
        self._by_storage.pop(value.untyped_storage().data_ptr(), None)
        dev = self.dev.upload(i, value, value if keep is None else keep)
        p.data = dev
        self._by_storage[dev.untyped_storage().data_ptr()] = i
        self.on_device.add(i)
        self._on_device_again(i)

    def _ready_for_compute(self, indices: Iterable[int]) -> None:
        """A device model's compute stream waits the copies of `indices`' weights before
        the work the host queues next (a forward, a backward node) reads them."""
        if self.dev is None:
            return
        for i in indices:
            self.dev.compute_waits(i, self.params[i].data)
        self.dev.compute_runs()

    def _drop_inflight(self, i: int) -> None:
        """Forget parameter i's read ahead (its bytes are the caller's to give back)."""
        fetch = self.inflight.pop(i)
        self.to_device.discard(i)
        if isinstance(fetch, Uploaded):
            # never read by compute work; kept, like any released buffer, until the compute
            # stream passed this point (the device window counts it until then)
            self.dev.release(i, fetch.value)
        else:
            fetch.wait()

    def _advance(self) -> None:
        """Reads ahead for the device that landed go on to it now, on the h2d stream, ahead
        of the module that needs them."""
        for i in list(self.to_device):
            fetch = self.inflight.get(i)
            if fetch is None or isinstance(fetch, Uploaded):
                self.to_device.discard(i)
            elif fetch.landed():
                self.inflight[i] = Uploaded(self.dev.upload(i, fetch.wait(), fetch.buf))
                self.to_device.discard(i)

    def _write_back(self, i: int) -> None:
        """Parameter `i`'s changed weights to their record: from the buffer they live in
        when the parameter still views it whole (no copy), else copied."""
        self.versions[i] = self.params[i]._version
        p, buf = self.params[i].detach(), self.bufs.get(i)
        if (i not in self.on_device and buf is not None and p.data_ptr() == buf.data_ptr()
                and p.is_contiguous()
                and p.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()):
            # the buffer is the write's now: if the weights stay (_write_kept), a later
            # write-back of them copies
            self.bufs.pop(i)
            self.records.write_buffer(WEIGHT, i, buf)
        else:
            self._write_copy(i)

    def _write_copy(self, i: int) -> None:
        """Parameter `i`'s weights to their record from a copy (they may change again while
        the write is in flight): a device buffer's brought back first."""
        self.versions[i] = self.params[i]._version
        p = self.params[i].detach()
        self.records.write(WEIGHT, i, self.dev.download(p) if i in self.on_device else p)

    def _write_kept(self, i: int) -> None:
        """Parameter `i`'s changed weights to their record while they stay in the window.
        Nothing changes them before their next update, and open_for_update (like a load
        or a roll-back) waits for that write first (`_settle`): the disk never reads a
        buffer being changed."""
        self._write_back(i)
        self.dirty.discard(i)

    def _settle(self, i: int) -> None:
        """Parameter `i`'s weights are about to change in place: the write of them still
        in flight (_write_kept's) lands first."""
        self.records.settle(WEIGHT, i)

    def _take(self, n: int) -> None:
        self.used += n
        self.stats.peak_window_bytes = max(self.stats.peak_window_bytes, self.used)
        if self.dev is not None:
            # device buffers released but still read by queued kernels count as well
            self.dev.bound(self.window - self.used)

    def _note_edit(self, i: int) -> None:
        """Materialised weights changed in place through their parameter since they last
        matched their record (not by the tier: its own changes mark them dirty) are dirty:
        written back before they are released, as torch would keep the change (a device
        buffer's through a copy that waits the kernels queued to change it: _write_back)."""
        if i in self.live:
            self._check_param(i)
        if i in self.live and self.params[i]._version != self.versions.get(i):
            self.dirty.add(i)
            self._mark_edited(i)

    def _evict(self, i: int) -> None:
        self._note_edit(i)
        if i in self.dirty:
            self._write_back(i)
            self.dirty.discard(i)
        if i in self.unwritten:  # a piece of it is still to be updated: kept in its record
            self.unwritten.discard(i)
            self.records.accumulate(i, self.params[i].grad, add=False)
            self.stats.grads_spilled += 1
        self._drop_grad(i)
        self._release_storage(i)
        self.used -= self.live.pop(i)
        self.stats.evictions += 1

    def _drop_grads_inflight(self) -> None:
        for i in list(self.grads_inflight):
            self.grads_inflight.pop(i).wait()
            self.used -= self._bytes(i)

    def _drop_grad(self, i: int) -> None:
        n = self.grads_out.pop(i, None)
        if n is not None:
            self.params[i].grad = None
            self.used -= n

    def _make_room(self, n: int, protect: set[int], *, must: bool, spill: bool = True,
                   only: set[int] | None = None, wait: bool = False,
                   before: float | None = None) -> bool:
        """Evict unpinned weights (the one needed furthest ahead first) until `n` more bytes
        fit, then (`spill`) write held gradients to their records, the last held first (the
        update takes the first ones next). Reads ahead that nobody waits for yet are dropped last.
        False (or an error when `must`) if the pinned weights leave no room. `only`: the
        weights that may be evicted (and nothing else made room by). While updates run
        during backward, the weights they still need and the held gradients go last:
        never for a read ahead (not `must`), and, with `wait` (backward's own reads), only
        once no queued update is left to free room first. `before`: the room is for a
        read ahead needed at that position of the learned order; only weights needed later
        than that make room for it (nothing else is evicted, nothing spilled)."""
        while self.used + n > self.window:
            free = [i for i in self.live if not self.pins.get(i) and i not in protect
                    and (only is None or i in only)]
            # while updates run during backward, a weight whose update is still to come is
            # read again if evicted now: those go last
            victim = self._furthest([i for i in free if not self._awaits_update(i)], before)
            if victim is None and before is not None:
                return False  # all of them are needed before what the room is for
            if victim is None and self.keep_grads and (free or self.held):
                if wait and self.backlog:  # the queued updates free weights and gradients
                    self.room.wait(0.001)
                    continue
                if not must:  # a read ahead costs no weight still to be updated, no spill
                    return False
            if victim is None and free:
                victim = free[0]
            if victim is not None:
                self._evict(victim)
                continue
            if only is not None:
                return False
            held = next((i for i in reversed(self.held) if i not in protect), None) \
                if spill else None
            if held is not None:
                self._spill(held)
                continue
            if not must:
                return False
            spare = next((i for i in self.inflight if i not in protect), None)
            early = next((i for i in self.grads_inflight if i not in protect), None)
            if spare is None and early is not None:
                self.grads_inflight.pop(early).wait()  # read again when it is needed
                self.used -= self._bytes(early)
                continue
            if spare is None and wait and self.backlog:
                # every weight is pinned, some by an update running during backward: it
                # unpins them when done (a compiled module's backward unpacks all its
                # saved weights at once, so it may ask while one runs)
                self.room.wait(0.001)
                continue
            if spare is None:
                pinned = [self.names[i] for i in self.live if self.pins.get(i)]
                raise TierMemError(
                    f"parameters.window ({format_size(self.window)}) cannot hold "
                    f"{format_size(n)} more: {format_size(self.used)} is in use by weights "
                    f"in use now ({', '.join(pinned[:4])}{', ...' if len(pinned) > 4 else ''})"
                    "; raise parameters.window")
            self._drop_inflight(spare)  # its buffer is freed with it
            self.used -= self._bytes(spare)
        return True

    def _furthest(self, free: list[int], before: float | None = None) -> int | None:
        """The weight of `free` (least recently used first) to evict: once the order is
        learned, the one needed furthest ahead (Belady), else the least recently used.
        `before`: only one needed later than that."""
        if not self._uses:
            return next(iter(free), None) if before is None else None
        best, best_use = None, before
        for i in free:
            use = self._next_use(i)
            if best_use is None or use > best_use:
                best, best_use = i, use
        return best

    def _next_use(self, i: int) -> float:
        """Position of parameter `i`'s next use in the learned order, from the cursor on
        (past the end of the order, the next iteration's, after the step), or of its update
        this step if that comes first: with the updates during backward, as soon as its
        last use of the iteration (its backward) is over, and otherwise in the step after
        backward, in the order the step opens the parameters (`expect_step_order`)."""
        order, uses = self.learned, self._uses[i]
        n, c = len(order), self._cursor
        if not uses:
            return float("inf")  # never requested by the order: out of it, on demand
        k = bisect.bisect_left(uses, c)
        # the next iteration's uses come after the step's, which fill [n, n + 1)
        use = uses[k] if k < len(uses) else 2 * n + uses[0]
        if self.params[i].requires_grad and i not in self.finished:
            if self.keep_grads:
                use = min(use, max(c, uses[-1]))
            else:
                rank = self.step_order.get(i)
                use = min(use, n if rank is None else n + rank / len(self.step_order))
        return use

    def _awaits_update(self, i: int) -> bool:
        return (self.keep_grads and self.has_grad[i] and i not in self.finished
                and (self.optimized is None or i in self.optimized))

    def _spill(self, i: int) -> None:
        """A held gradient to its record, out of the window."""
        stored = self.records.accumulate(i, self.held.pop(i), add=False)
        self.stats.grads_spilled += 1
        self.norms[i] = torch.linalg.vector_norm(stored, 2)
        self.used -= self._bytes(i)

    def _drop_held(self, i: int) -> None:
        if self.held.pop(i, None) is not None:
            self.used -= self._bytes(i)

    def _materialise(self, i: int, *, wait: bool = True, device: bool = False) -> None:
        """Parameter `i`'s weights in the window. wait: may wait for queued updates to free
        room (backward's reads; not the update's own). device: a device model's weights
        on its device (a forward's, a backward's), else in host memory (the step's)."""
        device = device and self.dev is not None
        if self._check_param(i):
            self._adopt(i)
        if i in self.live and self.dev is not None and (i in self.on_device) != device:
            if device:
                self._to_device(i)
            else:
                self._evict(i)  # the record holds the same weights: read into host memory
        if i in self.live:
            self.live.move_to_end(i)
            return
        while i in self.arriving:  # the other thread's read of it: installed when done
            self.room.wait(0.001)
            if i in self.live:
                self.live.move_to_end(i)
                return
        fetch = self.inflight.get(i)
        if isinstance(fetch, Uploaded) and not device:
            self._drop_inflight(i)  # read ahead for the device, wanted on the host
            self.used -= self._bytes(i)
        fetch = self.inflight.pop(i, None)
        self.to_device.discard(i)
        if fetch is None:
            self._make_room(self._bytes(i), set(self.pins), must=True, wait=wait)
            if self._present(i):
                # the other thread read it while this one waited for room (outside the
                # lock): a second read would leave one in flight that a write of the
                # weights makes stale
                self._materialise(i, wait=wait, device=device)
                return
            self._take(self._bytes(i))
            fetch = self.records.fetch(WEIGHT, i)
            self.stats.on_demand += 1
        else:
            self.stats.prefetched += 1
        self.stats.fetches += 1
        self.arriving.add(i)
        try:
            value = self._await(fetch)
        finally:
            self.arriving.discard(i)
        if device:
            if not isinstance(fetch, Uploaded):
                value = self.dev.upload(i, value, fetch.buf)
            self._install_weight(i, value, None)
            self.on_device.add(i)
            self._on_device_again(i)
        else:
            self._install_weight(i, value, fetch.buf)
            if self.dev is not None:
                self._rehook.add(i)
        if self.keep_grads:
            self.room.notify_all()

    def _adopt(self, i: int) -> None:
        """New weights assigned to released parameter `i`'s p.data (_check_param): its
        window copy from now on, written back like any change (a read of the record in
        flight is stale)."""
        if i in self.inflight:
            self._drop_inflight(i)
            self.used -= self._bytes(i)
        value = self.params[i].data
        self._make_room(self._bytes(i), set(self.pins) | {i}, must=True)
        self._take(self._bytes(i))
        self._install_weight(i, value, None)
        self.dirty.add(i)
        self._mark_edited(i)

    def _await(self, fetch: Fetch) -> torch.Tensor:
        """fetch.wait(); while updates run during backward, the read is waited for outside
        the lock, so that the other thread goes on meanwhile."""
        if self.keep_grads:
            while not fetch.landed():
                self.room.wait(0.0002)
        return fetch.wait()

    def _read_ahead(self, units: Sequence[int], start: int) -> None:
        """Read ahead the weights of `units`, the learned order's from position `start`,
        as far as the window has room or holds weights needed later than them."""
        wanted = [(start + k, i) for k, u in enumerate(units) for i in self.units[u]]
        protect = {i for _, i in wanted} | set(self.pins)
        for pos, i in wanted:
            if self._present(i):
                continue
            if not self._make_room(self._bytes(i), protect, must=False, before=pos):
                return
            self._fetch_ahead(i)

    def _present(self, i: int) -> bool:
        """Parameter `i`'s weights are in the window, read ahead, or being read by the
        other thread: no read of them is to be issued."""
        return i in self.live or i in self.inflight or i in self.arriving

    def _fetch_ahead(self, i: int) -> None:
        """Issue the read of `i`'s weights into window room made for them."""
        self._take(self._bytes(i))
        self.inflight[i] = self.records.fetch(WEIGHT, i)
        if self.dev is not None:
            self.to_device.add(i)

    def _fill_next(self) -> None:
        """The next forward's first weights the window lacks, read now into the room it has
        free (nothing evicted): backward is over, so what is left of this step (the last
        updates during backward) mostly writes, and the read queue would otherwise wait
        for forward. Up to the first unit the order requests a second time (backward)."""
        if self.dev is not None or not self.prefetch:
            return
        seen: set[int] = set()
        for u in self.learned:
            if u in seen:
                return
            seen.add(u)
            for i in self.units[u]:
                if self._present(i):
                    continue
                if self.used + self._bytes(i) > self.window:
                    return
                self._fetch_ahead(i)

    def _ahead(self, order: list[int], c: int) -> list[int]:
        """The units to read ahead from position `c` of `order`: `prefetch` of them, and
        more while the ones taken hold fewer than ahead_bytes."""
        end, held = c, 0
        while end < len(order) and (end - c < self.prefetch or held < self.ahead_bytes):
            held += sum(self._bytes(i) for i in self.units[order[end]])
            end += 1
        return order[c: end]

    def _request(self, u: int) -> None:
        """Unit `u` is needed now: follow (or learn) the order, read the next ones ahead."""
        if self.learned is None:
            if (not self._recording or self._recording[-1] != u) and \
                    len(self._recording) < MAX_ORDER:
                self._recording.append(u)
            return
        self._follow(u)
        if self.dev is not None:
            self._advance()

    def _follow(self, u: int) -> None:
        """_request past the first iteration: check `u` against the learned order."""
        order, c = self.learned, self._cursor
        if c < len(order) and order[c] == u:
            c += 1
        elif not (c > 0 and order[c - 1] == u):
            self.stats.out_of_order += 1
            try:
                c = order.index(u, c) + 1
            except ValueError:
                pass  # not ahead in the order: keep the place, fetch this one on demand
        self._cursor = c
        if self.prefetch:
            self._read_ahead(self._ahead(order, c), c)

    def _pin(self, i: int) -> None:
        self.pins[i] = self.pins.get(i, 0) + 1

    def _unpin(self, i: int) -> None:
        left = self.pins.get(i, 0) - 1
        if left > 0:
            self.pins[i] = left
        else:
            self.pins.pop(i, None)

    @_locked
    def take_gradients(self, params: Iterable[torch.Tensor]) -> None:
        """The parameters of `params` that require a gradient (unfrozen since the block
        opened) have their gradients come to the tier from now on, before any other hook
        is registered on them: a group added inside the block whose updates run during
        backward (pipeline.overlap_backward) registers the overlap's hook next, which must
        find the gradient stored when it fires. Each one's weights are read in for its
        gradient node (_hook_grad), one at a time."""
        self._check_open()
        for i in self._unhooked(self.indices(params)):
            self._pin(i)
            try:
                self._materialise(i, device=True)
                self._ready_for_compute([i])
                self._hook_grad(i)
            finally:
                self._unpin(i)

    @untraced
    def _guarded(self, func: Any, args: Any, kwargs: Any,
                 found: list[torch.nn.Parameter], caller: Any) -> Any:
        """A torch call `func` given parameters `found` (UseGuard), made from frame `caller`
        (None: code torch.compile traced, the model's forward or the user's)."""
        if self.lock._is_owned():  # the tier's own work on this thread (a hook, the step)
            return func(*args, **kwargs)
        if self._hooks_ctx:  # the model's forward (or a unit's called on its own)
            for p in found:
                self._use(p)
            if func == _DATA and not _tiers_own(caller):
                self._data_taken(found)
            return func(*args, **kwargs)
        if func in _NO_VALUES or self._closed:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in ("__set__", "__delete__"):  # p.data = new (_check_param's), p.grad = ...
            if (func == _GRAD_SET and len(args) > 1 and args[1] is not None
                    and not _tiers_own(caller)):
                self._refuse_grad_set(args[0])
            return func(*args, **kwargs)
        idx = [i for p in found if (i := self.index.get(id(p))) is not None]
        released = [i for i in idx if not self._ready(i)]
        # under overlap the worker may evict a live weight while the call reads it: pinned;
        # a device model's weights in place may still be on their way (read ahead, or the
        # step's upload): the compute stream waits for them
        if (not released and func != _DATA and not (idx and (self.keep_grads or self.dev))
                and not (torch.is_grad_enabled() and self._unhooked(idx))):
            return func(*args, **kwargs)
        if _tiers_own(caller):
            return func(*args, **kwargs)
        if func in _SELF_IF_SAME and released and args and args[0] is found[0]:
            out = func(*args, **kwargs)  # on the placeholder: no elements, nothing read
            if out is args[0]:
                return out
        if func in _LIKE and released:
            # the weights' shape, dtype and device only
            stand = {id(self.params[i]): self.stand_in(self.params[i]) for i in released}
            return func(*(stand.get(id(a), a) for a in args),
                        **{k: stand.get(id(v), v) for k, v in kwargs.items()})
        if func in _SHAPED:
            if not released:
                return func(*args, **kwargs)
            stand = {id(self.params[i]): self._meta(i) for i in released}
            return func(*(stand.get(id(a), a) for a in args),
                        **{k: stand.get(id(v), v) for k, v in kwargs.items()})
        self._read(idx)
        try:
            if func == _DATA:
                self._data_taken(found)
            return func(*args, **kwargs)
        finally:
            self._unread(idx)

    @contextlib.contextmanager
    def guard_aside(self) -> Iterator[None]:
        """The block's guard off this thread's mode stack for the optimizer step: tiermem's
        own work, whose every torch call (thousands a step, most with no parameter) would
        pass through it for nothing. Left where it is under a mode pushed after it."""
        g = self._guard
        if (g is None or threading.get_ident() != self._guard_thread
                or torch.overrides._get_current_function_mode() is not g):
            yield
            return
        g.__exit__(None, None, None)
        try:
            yield
        finally:
            if self._guard is g:  # (not closed meanwhile)
                g.__enter__()

    def _meta(self, i: int) -> torch.Tensor:
        """A meta tensor of parameter `i`'s shape and dtype (no memory), made once."""
        t = self._metas.get(i)
        if t is None:
            m = self.records.metas[i]
            t = self._metas[i] = torch.empty(m.shape, dtype=m.dtype, device="meta")
        return t

    def _refuse_grad_set(self, p: torch.Tensor) -> None:
        """A gradient set by hand on a released parameter: torch refused it for the empty
        placeholder's size, and the step would never see it (the gradients are the tier's)."""
        i = self.index.get(id(p))
        if i is None or self._ready(i):
            return  # (a live one's: the step refuses it, before it would pass it over)
        raise TierMemError(
            f"parameters.offload: p.grad of {self.names[i]} was set by hand inside the block: "
            "the gradients live in the parameter tier, which a p.grad set by hand never "
            "reaches (the step would pass it over). Gradients come from backward. "
            "torch.distributed.checkpoint's get_optimizer_state_dict, get_state_dict and "
            "set_optimizer_state_dict set zeros to make a never-stepped optimizer's state: "
            "call them after its first step, or before entering the block")

    def released_name(self, p: torch.Tensor) -> str | None:
        """The name of `p` if it is this open tier's and its weights are not in p.data where
        the model computes (compiled.py keeps such a parameter out of dynamo's graphs)."""
        i = self.index.get(id(p))
        if i is None or self._closed or self._ready(i):
            return None
        return self.names[i]

    def _ready(self, i: int) -> bool:
        """Parameter `i`'s weights are in p.data where the model computes."""
        return i in self.live and (self.dev is None or i in self.on_device)

    @_locked
    def _read(self, idx: list[int]) -> None:
        """Parameters `idx` materialised (on demand, out of the learned order) and pinned
        for a call outside the model's forward."""
        self._check_open()
        need = sum(self._bytes(i) for i in idx) if len(idx) > 1 else 0
        if need > self.window:
            names = ", ".join(self.names[i] for i in idx[:4]) + (", ..." if idx[4:] else "")
            raise TierMemError(
                f"parameters.offload: a torch call outside the model's forward was given "
                f"{len(idx)} weights of the parameter tier at once ({names}): they must be in "
                f"memory together, {format_size(need)}, more than parameters.window "
                f"({format_size(self.window)}) holds. Make the call over fewer at a time "
                "(one per parameter), or raise parameters.window")
        self._busy = True
        try:
            for i in idx:
                self._pin(i)
            for i in idx:
                if not self._ready(i):
                    self._materialise(i, device=True)
                    self.stats.outside_forward += 1
            self._ready_for_compute(idx)
            self._hook_unfrozen(idx)  # the call may make a gradient node (a loss term)
        except BaseException:
            for i in idx:
                self._unpin(i)
            raise
        finally:
            self._busy = False

    @_locked
    def _unread(self, idx: list[int]) -> None:
        for i in idx:
            self._unpin(i)

    @_locked
    def _data_taken(self, found: list[torch.nn.Parameter]) -> None:
        """p.data taken of live weights: a change through it moves no version counter, so
        they are written back before their release, as if changed (a device buffer's
        through a copy back: _write_back)."""
        for p in found:
            i = self.index.get(id(p))
            if i is None or i not in self.live:
                continue
            self._settle(i)  # a write of them in flight lands before they change
            self.dirty.add(i)
            self._mark_edited(i)
            self.stats.data_taken += 1

    @_locked
    def _use(self, p: torch.Tensor) -> None:
        i = self.index.get(id(p))
        if i is None:
            return
        if self._ready(i):
            if i not in self._grad_hooked:  # (every use in a forward passes here)
                self._hook_unfrozen([i])
            return
        self._busy = True
        try:
            self._request(self.unit_of[i])
            self._materialise(i, device=True)
            self._ready_for_compute([i])
            self._hook_unfrozen([i])
            self.stats.outside_hooks += 1
        finally:
            self._busy = False

    @_locked
    def _enter(self, u: int) -> None:
        self._check_open()
        self._busy = True  # the tier's own tensor work is not a use of a weight
        self._running[u] += 1
        try:
            self._request(u)
            for i in self.units[u]:
                self._pin(i)
            for i in self.units[u]:
                self._materialise(i, device=True)
            self._ready_for_compute(self.units[u])
            # (p.requires_grad too: read outside, UseGuard would count it a use)
            self._hook_unfrozen(self.units[u])
            if not self._hooks_ctx and torch.is_grad_enabled() and _no_saved_hooks():
                # A unit run outside the model's forward: a reentrant checkpoint's
                # recomputation during backward, a submodule called on its own. What its
                # forward saves of its weights is kept by geometry too; saved as the
                # parameter itself, the weights were gone (p.data empty) once evicted
                # before the backward that read them. (Not under saved-tensor hooks of
                # someone else's, which ours would hide: a non-reentrant checkpoint's
                # recomputation keeps what it saves itself.)
                self._push_saved_hooks(None, None, unit=(u, self._running[u]))
        finally:
            self._busy = False

    @_locked
    def _leave(self, u: int) -> None:
        for i in self.units[u]:
            self._unpin(i)
        if self._hooks_unit and self._hooks_unit[-1] == (u, self._running[u]):
            self._pop_saved_hooks()
        self._running[u] = max(0, self._running[u] - 1)

    def _check_open(self) -> None:
        if self._closed:
            raise TierMemError("the parameter tier of this model was closed")

    # -- saved tensors --------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> Any:
        if t.layout != torch.strided:
            return t
        try:
            i = self._by_storage.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # tensors without a plain storage
            return t
        if i is None:
            return t
        p = self.params[i]
        if t.dtype != p.dtype or p.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
            return t  # a reinterpretation: keep it (the values stay right, the window grows)
        return Saved(i, t.size(), t.stride(), t.storage_offset() - p.storage_offset(),
                     self.steps)

    @_locked
    def _unpack(self, x: Any) -> torch.Tensor:
        if not isinstance(x, Saved):
            return x
        if x.version != self.steps:
            raise TierMemError(
                f"backward needs {self.names[x.index]} as its forward saw it, but an optimizer "
                "step has changed it since; run backward before opt.step()")
        if x.index in self.opened:
            raise TierMemError(
                f"backward needs {self.names[x.index]} as its forward saw it, but its update "
                "started during this backward (pipeline.overlap_backward: its gradient was "
                "final, yet something saved its weights for later, outside autograd); set "
                "pipeline.overlap_backward: false")
        self._check_open()
        self._request(self.unit_of[x.index])
        self._materialise(x.index, device=True)
        self._ready_for_compute([x.index])
        p = self.params[x.index].detach()
        return p.as_strided(x.size, x.stride, p.storage_offset() + x.offset)

    # -- gradients ------------------------------------------------------------------

    @_locked
    def _before_accumulate(self, i: int) -> None:
        self._check_open()
        self._request(self.unit_of[i])
        self._pin(i)
        self._materialise(i, device=True)
        self._ready_for_compute([i])

    @_locked
    def _grad_ready(self, p: torch.Tensor) -> None:
        i = self.index[id(p)]
        self._unpin(i)
        self._refuse_stale([i], "a backward")
        g, p.grad = p.grad, None
        if g is None:
            return
        if self.dev is None:
            self.store_gradient(p, g)
            return
        self.dev.grad_out(i, g)  # to pinned staging on the d2h stream; stored once landed
        self.dev.land(self._store_landed, every=False)
        if not self._landing_queued:
            # the rest land once backward is over: has_gradient, clip and the step see them
            torch.autograd.Variable._execution_engine.queue_callback(self._land_all)
            self._landing_queued = True

    def _store_landed(self, i: int, g: torch.Tensor) -> None:
        self.store_gradient(self.params[i], g)

    @_locked
    def _land_all(self) -> None:
        self._landing_queued = False
        self._settle_grads()

    def _settle_grads(self) -> None:
        """A device model's gradients still on their way from the device, in their records."""
        if self.dev is not None and self.dev.landing:
            self.dev.land(self._store_landed, every=True)

    def _host_step(self) -> None:
        """The step reads weights in host memory: a device model's gradients landed, and its
        device copies of weights released (their records hold the same values)."""
        if self.dev is None or self._stepping:
            return
        self._stepping = True
        self._settle_grads()
        for i in [i for i in self.live if i in self.on_device and not self.pins.get(i)]:
            self._evict(i)
        for i in [i for i, f in self.inflight.items() if isinstance(f, Uploaded)]:
            self._drop_inflight(i)
            self.used -= self._bytes(i)

    @_locked
    def store_gradient(self, p: torch.Tensor, g: torch.Tensor) -> None:
        """`g` is (another part of) parameter `p`'s gradient for the coming step: stored or
        added, as backward's hook does (stress runs give synthetic gradients this way)."""
        i = self.index[id(p)]
        if g.shape != self.records.metas[i].shape or g.dtype != self.records.metas[i].dtype:
            raise TierMemError(f"gradient of {self.names[i]}: got {g.dtype} "
                               f"{tuple(g.shape)}, expected {self.records.metas[i].dtype} "
                               f"{tuple(self.records.metas[i].shape)}")
        if g.layout != torch.strided:
            raise TierMemError(f"parameters.offload: {self.names[i]} got a {g.layout} "
                               "gradient; only dense gradients are supported")
        self._refuse_stale([i], "a gradient stored")
        if i in self.zeroed:
            # torch adds into the zeros: a -0.0 of the new gradient becomes +0.0 (in place
            # where it can: the tier owns a gradient handed to it, as `held` shows)
            self.zeroed.discard(i)
            if g.is_floating_point():
                g = g.add_(0.0) if g.is_contiguous() else g + 0.0
        n = self._bytes(i)
        if i in self.held:
            self.held[i].add_(g)
        elif self.keep_grads and not self.has_grad[i] and self._room_to_hold(n):
            # kept as autograd made it (p.grad no longer refers to it): no copy into a
            # record buffer, no write, no read back, no norm pass (clip_grad_norm_ takes it)
            self._take(n)
            self.held[i] = g if g.is_contiguous() else g.contiguous()
            self.stats.grads_held += 1
        else:
            stored = self.records.accumulate(i, g, add=self.has_grad[i])
            # the norm of the stored (accumulated) gradient: final once backward is
            self.norms[i] = torch.linalg.vector_norm(stored, 2)
        self.has_grad[i] = True
        self.grad_stores[i] += 1
        self.stats.grads_stored += 1

    def _room_to_hold(self, n: int) -> bool:
        """Room in the window for a gradient of `n` bytes kept in memory: made from weights
        whose update is done, else waited for while updates are queued (they free their
        weights and gradients), else made as for any other read (False: no room)."""
        while not self._make_room(n, set(self.pins), must=False, only=self.finished):
            if not self.backlog:
                return self._make_room(n, set(self.pins), must=False, spill=False)
            self.room.wait(0.05)
        return True

    def queue_update(self) -> None:
        """A partition was queued for an update during backward."""
        with self.lock:
            self.backlog += 1

    def unqueue_update(self) -> None:
        """A queued partition was updated (or dropped)."""
        with self.lock:
            self.backlog = max(0, self.backlog - 1)
            self.room.notify_all()

    @_locked
    def gradient(self, p: torch.Tensor) -> torch.Tensor | None:
        """A copy of `p`'s stored gradient as the step will read it (clip applied)."""
        self._settle_grads()
        self._fill_zeroed()
        i = self.index[id(p)]
        if not self.has_grad[i]:
            return None
        if i in self.held:
            g = self.held[i].clone()
            return g if self.clip_coef is None else g.mul_(self.clip_coef)
        self.records.drain()
        g = self.records.fetch(GRAD, i).wait().clone()
        if self.clip_coef is not None:
            g.mul_(self.clip_coef)
        return g

    def stand_in(self, p: torch.Tensor) -> torch.Tensor:
        """A tensor of `p`'s shape and dtype that holds no memory (p is empty between
        uses): for code that needs only its shape."""
        m = self.records.metas[self.index[id(p)]]
        return torch.empty((), dtype=m.dtype, device=p.device).expand(m.shape)

    def handed_out(self, p: torch.Tensor) -> bool:
        """p.grad is the gradient the tier gave the step (one the step has not dropped yet,
        as after a step that failed part-way), not one set by hand."""
        return self.index.get(id(p)) in self.grads_out

    def weight_nbytes(self, p: torch.Tensor) -> int:
        """Bytes `p`'s weights take in the window when materialised."""
        return self._bytes(self.index[id(p)])

    def current_weight(self, p: torch.Tensor) -> torch.Tensor:
        """A copy of `p`'s weights as they are now (window or record)."""
        return self.weight(self.index[id(p)])

    @_locked
    def zero_grad(self, params: Iterable[torch.Tensor] | None = None, *,
                  set_to_none: bool = True) -> None:
        """Forget the stored gradients of `params` (all when None), as torch's zero_grad
        drops p.grad: the next backward stores instead of adding. set_to_none=False: a
        parameter that had a gradient (this step's or the last step's) keeps one of zeros,
        as torch's p.grad, which the next step updates it with."""
        self._settle_grads()  # a landing gradient belongs to a backward before this call
        for i in (range(len(self.params)) if params is None else self.indices(params)):
            had = self.has_grad[i] or i in self.stale or i in self.zeroed
            self.stale.discard(i)
            if had and not set_to_none:
                self.zeroed.add(i)
            else:
                self.zeroed.discard(i)
            self.has_grad[i] = False
            self.norms.pop(i, None)
            self.unwritten.discard(i)
            self.spent.discard(i)
            self._drop_grad(i)
            self._drop_held(i)
        self.grad_edits += 1
        if not any(self.has_grad):
            self.clip_coef = None

    def _store_zeroed(self, i: int) -> None:
        """Parameter i's zeros left by zero_grad(set_to_none=False), into its record."""
        self.zeroed.discard(i)
        m = self.records.metas[i]
        stored = self.records.accumulate(i, torch.zeros(m.shape, dtype=m.dtype), add=False)
        self.norms[i] = torch.linalg.vector_norm(stored, 2)
        self.has_grad[i] = True
        self.grad_stores[i] += 1
        self.stats.grads_stored += 1

    def _fill_zeroed(self) -> None:
        """The gradients of zeros that zero_grad(set_to_none=False) left, stored now that
        something reads them (norm, clip, step); a backward since has replaced them."""
        for i in sorted(self.zeroed):
            self.zeroed.discard(i)
            m = self.records.metas[i]
            self.store_gradient(self.params[i], torch.zeros(m.shape, dtype=m.dtype))

    def _refuse_stale(self, indices: Iterable[int], what: str) -> None:
        stale = [i for i in indices if i in self.stale]
        if stale:
            raise TierMemError(
                f"{what} for {self.names[stale[0]]} with no zero_grad() since the last "
                "optimizer.step(): torch would add to (or step with) the gradient that step "
                "used, which parameters.offload does not keep. Call optimizer.zero_grad() "
                "(or model.zero_grad()) after each step")

    def before_step(self, params: Iterable[torch.Tensor]) -> None:
        """A step of the optimizer holding `params` begins (backward is over): refuse one
        torch would take with the last step's gradients (no zero_grad since, no backward
        either), and store the zeros zero_grad(set_to_none=False) left where no backward
        replaced them, for the step to read."""
        with self.lock:
            self._refuse_stale(self.indices(params), "optimizer.step()")
            self._settle_grads()
            self._fill_zeroed()

    @_locked
    def with_grads(self) -> set[int]:
        """Indices (in model.parameters() order) of parameters holding a gradient (zeros
        left by zero_grad(set_to_none=False) count, as in torch)."""
        self._settle_grads()
        return {i for i, h in enumerate(self.has_grad) if h or i in self.zeroed}

    @_locked
    def grad_mark(self, p: torch.Tensor) -> tuple[int, int]:
        """What changes when `p`'s gradient does: a backward stores one, zero_grad and clip
        edit them all."""
        return self.grad_stores[self.index[id(p)]], self.grad_edits

    def has_gradient(self, p: torch.Tensor) -> bool:
        # (not stored here: during backward, this would write zeros the hook then adds to)
        self._settle_grads()
        i = self.index.get(id(p))
        return i is not None and (self.has_grad[i] or i in self.zeroed)

    @_locked
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the stored gradients by their global norm, as torch.nn.utils.clip_grad_norm_
        over model.parameters(): returns the total norm; the step applies the coefficient
        as it reads each gradient. error_if_nonfinite: raise torch's error, before any
        coefficient is kept, where the norm is inf or nan."""
        if norm_type != 2.0:
            raise TierMemError(f"clip_grad_norm_ with parameters.offload computes the 2-norm "
                               f"as gradients stream; norm_type={norm_type} is not supported")
        self._settle_grads()
        self._fill_zeroed()
        self.grad_edits += 1
        norms = [torch.linalg.vector_norm(self.held[i], 2) if i in self.held else self.norms[i]
                 for i in range(len(self.params)) if self.has_grad[i]]
        if not norms:
            return torch.tensor(0.0)
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} for gradients from `parameters` "
                "is non-finite, so it cannot be clipped. To disable this error and scale the "
                "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        # a second clip before the step multiplies again, as torch's would
        self.clip_coef = coef if self.clip_coef is None else self.clip_coef * coef
        return total

    # -- the optimizer step ---------------------------------------------------------

    def indices(self, params: Iterable[torch.Tensor]) -> list[int]:
        out: list[int] = []
        for p in params:
            i = self.index.get(id(p))
            if i is None:
                raise TierMemError("the optimizer holds a parameter that is not the model's "
                                   "(parameters.offload manages model.parameters() only)")
            if i not in out:
                out.append(i)
        return out

    @_locked
    def open_for_update(self, params: Iterable[torch.Tensor]) -> list[int]:
        """Materialise `params` with their gradients (scaled by the clip coefficient) for
        the update about to run; returns their indices for updated()."""
        self._check_open()
        self._host_step()
        opened = self.indices(params)
        if self.keep_grads:  # the update runs during backward: unpack checks against it
            self.opened.update(opened)
        for i in opened:
            self._pin(i)
        for i in opened:
            if i in self.zeroed:
                # A frozen parameter's zeros from zero_grad(set_to_none=False) are final from
                # the forward on: an update during backward (its partition waits for no hook
                # of it) reads them here, before step()'s before_step would store them. Not
                # kept in the window: room for a held gradient waits on queued updates,
                # this one among them.
                self._store_zeroed(i)
            self._materialise(i, wait=False)
            self._settle(i)
            if self.has_grad[i] and i not in self.grads_out:
                if i in self.spent:
                    raise TierMemError(
                        f"the gradient of {self.names[i]} was used by an update during "
                        "backward of a step that failed, and the parameter tier does not "
                        "keep it (pipeline.overlap_backward): call optimizer.zero_grad() and "
                        "run the forward and backward again before optimizer.step()")
                n = self._bytes(i)
                if i in self.held and self.clip_coef is not None:
                    self._spill(i)  # scaled below: the record keeps the gradient as it was
                if i in self.held:
                    g = self.held.pop(i)  # its bytes stay taken, now as grads_out
                    self.unwritten.add(i)
                else:
                    fetch = self.grads_inflight.pop(i, None)
                    if fetch is None:
                        self._make_room(n, set(self.pins), must=True)
                        self._take(n)
                        fetch = self.records.fetch(GRAD, i)
                    g = self._await(fetch)
                if self.clip_coef is not None:
                    g.mul_(self.clip_coef)  # as torch's clip: the fp32 coefficient
                self.params[i].grad = g
                self.grads_out[i] = n
        return opened

    @_locked
    def read_ahead_update(self, params: Iterable[torch.Tensor]) -> None:
        """The next partition's parameters: start reading their weights and gradients
        now, as far as the window allows without evicting what is open (nothing with
        parameters.prefetch 0)."""
        if not self.prefetch:
            return
        self._host_step()
        wanted = self.indices(params)
        protect = set(wanted) | set(self.pins)
        for i in wanted:
            if not self._present(i):
                if not self._make_room(self._bytes(i), protect, must=False):
                    return
                self._take(self._bytes(i))
                self.inflight[i] = self.records.fetch(WEIGHT, i)
            if (self.has_grad[i] and i not in self.grads_out and i not in self.grads_inflight
                    and i not in self.held):
                if not self._make_room(self._bytes(i), protect, must=False):
                    return
                self._take(self._bytes(i))
                self.grads_inflight[i] = self.records.fetch(GRAD, i)

    @contextlib.contextmanager
    def materialised(self, params: Iterable[torch.Tensor], *, changed: bool = False
                     ) -> Iterator[None]:
        """`params`' weights in place for the duration: read only (a check, an init), or
        `changed` (a crash-consistent resume or roll-back writing the committed weights):
        then written back to their records like updated ones."""
        idx = self.indices(params)
        with self.lock:
            for i in idx:
                self._pin(i)
        try:
            self._materialise_for(idx, changed)
            yield
            if changed:
                with self.lock:
                    self.dirty.update(idx)
                    for i in idx:  # (tiermem's own writes: no edit of the user's)
                        if i in self.live:
                            self.versions[i] = self.params[i]._version
        finally:
            with self.lock:
                for i in idx:
                    self._unpin(i)

    @contextlib.contextmanager
    def shaped(self, params: Iterable[torch.Tensor]) -> Iterator[None]:
        """`params` hold their shape for the duration, read or not: a released one a
        stand-in of its shape, dtype and device that holds no memory (stand_in), a live one
        its weights, pinned. Laying out the optimizer records of a group added inside the
        block reads shapes only, and the group may be larger than the window."""
        idx = self.indices(params)
        if self.device.type != "cpu":
            # The layout depends on the device a parameter trains on (a device model's
            # records keep an fp32 master), and a stand-in there would take device memory.
            raise TierMemError(
                f"parameters.offload: laying out optimizer records inside the block for "
                f"parameters of a model on {self.device} ({self.names[idx[0]]}, ...) is not "
                "built yet: add the param group before tiermem.offload (a group whose "
                "parameters are frozen until later is passed over by torch until then)")
        swapped = []
        with self.lock:
            self._check_open()
            for i in idx:
                # a change made behind the tier first: kept (new weights assigned: live
                # now) or refused, never laid out from the placeholder's size, which would
                # give the parameter no record
                if self._check_param(i):
                    self._adopt(i)
            for i in idx:
                self._pin(i)
                if i not in self.live:
                    # (set_data moves no version counter: the release's record stays right)
                    self.params[i].data = _untouched(self.records.metas[i])
                    swapped.append(i)
        try:
            yield
        finally:
            with self.lock:
                for i in swapped:
                    p = self.params[i]
                    p.data = torch.empty(0, dtype=self.records.metas[i].dtype,
                                         device=p.device)
                for i in idx:
                    self._unpin(i)

    @_locked
    def _materialise_for(self, idx: list[int], changed: bool) -> None:
        for i in idx:
            self._materialise(i)
            if changed:
                self._settle(i)

    @_locked
    def expect_step_order(self, params: Iterable[torch.Tensor]) -> None:
        """The step after backward is about to open `params`, in this order: a weight it
        still has to update is needed at its place there (eviction by next use)."""
        self.step_order = {i: k for k, i in enumerate(self.indices(params))}

    @_locked
    def optimizer_holds(self, params: Iterable[torch.Tensor]) -> None:
        """The optimizer holds `params` (as well as any it held before): its steps consume
        their gradients."""
        self.optimized = (self.optimized or set()) | set(self.indices(params))

    @_locked
    def expect_updates(self, pieces: Iterable[tuple[torch.Tensor, int]]) -> None:
        """How many optimizer partitions hold a piece of each parameter (one by default):
        its gradient is dropped once that many updates of a step opened it."""
        for p, n in pieces:
            self.pieces[self.indices([p])[0]] = n

    @_locked
    def round_over(self) -> None:
        """A step that ran during backward ended without step_done() (it raised): the
        weights it opened are no longer being updated."""
        self._forget_round()

    def _forget_round(self) -> None:
        """What the updates during a backward tracked: none is running any more."""
        self.opened.clear()
        self.updates.clear()
        self.finished.clear()
        self.step_order.clear()
        self.backlog = 0

    @_locked
    def updated(self, opened: list[int]) -> None:
        """The update of `opened` is done: their weights changed, and a parameter whose every
        piece is updated has its gradient dropped and its weights written back now."""
        for i in opened:
            if self.has_grad[i]:
                self.dirty.add(i)
                # the update started from them, or from a master that took them first
                self.edited.discard(i)
                if i in self.live:  # its writes of the weights are no edit (dirty, above)
                    self.versions[i] = self.params[i]._version
                self.updates[i] = self.updates.get(i, 0) + 1
                if self.updates[i] >= self.pieces[i]:
                    if i in self.unwritten:
                        self.spent.add(i)
                    self.unwritten.discard(i)
                    self._drop_grad(i)
                    self.finished.add(i)
                    # Written now rather than by step_done: the writes spread over the step
                    # (over backward, with overlap_backward) instead of all waiting at its
                    # end, when the disk only writes and the caller copies
                    self._write_kept(i)
            self._unpin(i)
            if self.keep_grads and self.learned and self._cursor >= len(self.learned):
                self._fill_next()
            if i in self.live and not self.pins.get(i) and (
                    not self.has_grad[i] or i in self.finished):
                # first out (before the order is learned; after, by next use): the step
                # visits each parameter once, so what it updated is done with, and
                # least-recently-used order would evict the weights the rest of the step
                # still needs instead (read again)
                self.live.move_to_end(i, last=False)

    def _mark_edited(self, i: int) -> None:
        self.edited.add(i)
        self.edits_pending.add(i)

    @_locked
    def take_pending_edits(self) -> set[int]:
        """The parameters whose weights were changed since the last call other than by the
        optimizer (see `edited`; a change counted conservatively, as p.data taken, is one
        too), forgotten here: the optimizer keeps them until its records took them."""
        for i in list(self.live):
            self._note_edit(i)
        pending, self.edits_pending = self.edits_pending, set()
        return pending

    @_locked
    def forget_edits(self, params: Iterable[torch.Tensor]) -> None:
        """The records of `params` were given new state (a load): the changes made to their
        weights before it are superseded, for the next step and the next commit."""
        for i in self.indices(params):
            if i in self.live:
                self._note_edit(i)
                self.versions[i] = self.params[i]._version
            self.edited.discard(i)
            self.edits_pending.discard(i)

    @_locked
    def take_edited(self) -> set[int]:
        """The parameters whose weights were changed since the last call other than by a
        step's update (see `edited`); forgotten here."""
        for i in list(self.live):
            self._note_edit(i)
        edited, self.edited = self.edited, set()
        return edited

    @_locked
    def step_done(self) -> None:
        """The step consumed every gradient: write the updated weights back, forget the
        gradients, and freeze (or follow) the learned order for the next iteration."""
        self._settle_grads()
        kept = self._keep_unstepped()
        for i in list(self.live):
            self._note_edit(i)
            if i in self.dirty:
                self._write_copy(i)
                self.dirty.discard(i)
            self._drop_grad(i)
        for i in list(self.grads_out):
            self._drop_grad(i)
        for i in list(self.held):  # stored for a parameter the optimizer does not update
            self._drop_held(i)
        # the gradients the optimizer's update read (a parameter it does not hold keeps
        # none in torch's eyes either way: no step reads it)
        self.stale = {i for i in self.finished if self.has_grad[i]}
        self._forget_round()
        self.unwritten.clear()
        self.spent.clear()
        self._drop_grads_inflight()
        self.has_grad = [i in kept for i in range(len(self.params))]
        self.norms = {i: n for i, n in self.norms.items() if i in kept}
        self.clip_coef = None
        self.steps += 1
        if self.learned is None and self._recording:
            self.learned = self._recording
            self._uses = [[] for _ in self.params]
            for pos, u in enumerate(self.learned):
                for i in self.units[u]:
                    self._uses[i].append(pos)
        self._cursor = 0
        if self.dev is not None:
            self._stepping = False
            for i in [i for i in self.live if i not in self.on_device and not self.pins.get(i)]:
                self._to_device(i)  # updated, written back: on the device for the next forward
        if self.learned and self.prefetch:
            self._read_ahead(self._ahead(self.learned, 0), 0)
            if self.dev is not None:
                self._advance()

    def _keep_unstepped(self) -> set[int]:
        """At a step's end: the gradients of parameters the optimizer does not hold stay,
        as their p.grad would in torch (a backward adds to them; opt.zero_grad() leaves
        them, model.zero_grad() drops them), in their records, clipped as torch's clip
        scaled them in place: an add_param_group of those parameters hands them to the
        next step. Returns their indices."""
        if self.optimized is None:
            return set()
        kept = {i for i, h in enumerate(self.has_grad) if h and i not in self.optimized}
        for i in sorted(kept):
            if i in self.held:
                self._spill(i)
        if self.clip_coef is not None and kept:
            self.records.drain()  # the spills above land before their records are read
            for i in sorted(kept):
                g = self.records.fetch(GRAD, i).wait().clone()
                g.mul_(self.clip_coef)  # as the step scales the ones it reads
                stored = self.records.accumulate(i, g, add=False)
                self.norms[i] = torch.linalg.vector_norm(stored, 2)
        return kept

    def plan(self) -> dict[str, Any]:
        """Where the weights and grads are and what the window holds (tm.plan())."""
        weights = sum(m.nbytes for m in self.records.metas)
        out = {"tier": self.records.tier, "weight_bytes": weights, "grad_bytes": weights,
               "pinned_bytes": self.records.resident_bytes(),
               "swap_bytes": self.records.store.total_bytes if self.records.store else 0,
               "swap_dirs": self.records.store.dirs if self.records.store else [],
               "window": self.window, "units": len(self.units),
               "learned_order": len(self.learned) if self.learned is not None else None}
        if self.dev is not None:
            # the window is device memory; the host holds the buffers the copies go through:
            # fetch buffers (reads ahead, the step's window, writes in flight) and the
            # gradients' staging
            out.update(device=str(self.device), device_window=self.window,
                       staging_bytes=self.records.recycler.limit + self.dev.staging.limit)
        return out

    # -- state dicts ----------------------------------------------------------------

    @_locked
    def weight(self, i: int) -> torch.Tensor:
        """Parameter `i`'s current weights as a tensor of their own (on the model's device)."""
        if self._check_param(i):
            self._adopt(i)
        if i in self.live:
            if i in self.on_device:
                self._ready_for_compute([i])  # the clone reads it on this stream
            return self.params[i].detach().to(self.device, copy=True)
        self.records.drain()
        return self.records.fetch(WEIGHT, i).wait().to(self.device, copy=True)

    def _fill_state_dict(self, u: int, sd: dict, prefix: str) -> None:
        m = self._unit_modules[u]
        for name, p in m._parameters.items():
            key = prefix + name
            if p is None or key not in sd or id(p) not in self.index:
                continue
            i = self.index[id(p)]
            value = self.weight(i)
            sd[key] = torch.nn.Parameter(value, requires_grad=p.requires_grad) \
                if isinstance(sd[key], torch.nn.Parameter) else value

    @_locked
    def _enter_load(self, u: int) -> None:
        self._check_open()
        for i in self.units[u]:
            self._pin(i)
            self._materialise(i)
            self._settle(i)  # the load writes into the weights

    @_locked
    def _leave_load(self, u: int) -> None:
        for i in self.units[u]:
            self.dirty.add(i)
            self._mark_edited(i)
            self._unpin(i)

    # -- leaving ----------------------------------------------------------------------

    def close(self) -> None:
        """Give the model its weights back as ordinary tensors (and any gradient not yet
        consumed by a step, as torch would hold it), remove the hooks and the records."""
        if self._closed:
            return
        need = sum(m.nbytes for m in self.records.metas) - sum(self.live.values())
        on_gpu = self.dev is not None and not self.dev.emulated
        free = torch.cuda.mem_get_info(self.device)[0] if on_gpu else available_memory()
        if need > free * 0.8:
            self.abandon()
            raise TierMemError(
                f"the model's weights ({format_size(need)} more) do not fit in free "
                f"{self.device if on_gpu else 'host'} memory ({format_size(free)}) to be given "
                "back at the end of the block; they were thrown away. Save what you need "
                "inside the block and call tm.discard() to leave without gathering them")
        try:
            # refused: given back from their records (the weights before the change), and
            # the error raised once every other weight is back
            refused: dict[int, TierMemError] = {}
            for i in range(len(self.params)):
                try:
                    if self._check_param(i):
                        self._adopt(i)
                except TierMemError as exc:
                    refused[i] = exc
            self._settle_grads()
            for i in [i for i in self.live if i not in refused]:
                self._note_edit(i)
                if i in self.dirty:
                    self._write_copy(i)
            self.dirty.clear()
            given = {i: self.params[i].grad for i in self.unwritten if i in self.grads_out}
            for i in list(self.grads_out):
                self._drop_grad(i)
            for i in list(self.inflight):
                try:
                    self._drop_inflight(i)
                except TierMemError:
                    # a read ahead that failed: every record is fetched anew below, and
                    # one that cannot be read is named there, without stopping the rest
                    pass
            self._drop_grads_inflight()
            self.records.drain()
            lost: list[tuple[str, TierMemError]] = []
            for i, p in enumerate(self.params):
                # One record that cannot be read must not take the others with it: the
                # records are removed below, so everything that can be read goes back
                # now, and the caller hears what could not.
                try:
                    if i in self.live and self.dev is None and i not in refused:
                        # a host model's window holds the weight as it is now: its record
                        # has every change made through the parameter (written above),
                        # not one made through p.data (Lightning's EMAWeightAveraging
                        # copies the averaged weights in that way at the end of the fit)
                        value = p.detach().to(self.device, copy=True)
                    else:
                        value = self.records.fetch(WEIGHT, i).wait().to(self.device,
                                                                        copy=True)
                except TierMemError as exc:
                    if i not in self.live or self.dev is not None or i in refused:
                        self._release_storage(i)
                        lost.append((self.names[i], exc))
                        continue
                    # a host model's window holds this weight as it is now (a dirty one
                    # was written above from this very tensor); a device side's copy may
                    # still be on its way, so there the weight counts as lost
                    value = p.detach().to(self.device, copy=True)
                try:
                    grad = (given[i] if i in given else self.held.pop(i) if i in self.held
                            else None if i in self.spent  # a failed step's update took it
                            else self.records.fetch(GRAD, i).wait().clone()
                            if self.has_grad[i] else torch.zeros_like(value)
                            if i in self.zeroed else None)
                except TierMemError as exc:
                    lost.append((f"{self.names[i]} (its gradient)", exc))
                    grad = None
                if grad is not None:
                    grad = grad.to(self.device)
                self._release_storage(i)
                p.data = value
                if grad is not None:
                    p.grad = grad
            self.live.clear()
            self.used = 0
            if lost:
                raise WeightsLost([name for name, _ in lost], lost[0][1]) from lost[0][1]
            if refused:
                raise next(iter(refused.values()))
        finally:
            self._closed = True
            self._unhook()

    def _unhook(self) -> None:
        """The end of close() and abandon(): hooks, saved-tensor hooks and records gone."""
        unregister(self)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._accumulators.clear()
        while self._hooks_ctx:
            self._pop_saved_hooks()
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.tier = None  # inert wherever it is on the stack
            # popped when it is on top of this thread's stack; under a mode the caller
            # pushed inside the block (and left open) it stays, inert, not to pop theirs
            if (threading.get_ident() == self._guard_thread
                    and torch.overrides._get_current_function_mode() is guard):
                guard.__exit__(None, None, None)
        if self.dev is not None:
            self.dev.close()  # after the releases above: every queued copy and kernel ran
        self.records.close()

    def abandon(self) -> None:
        """Close without giving the weights back (tm.discard(): benchmarks, stress runs):
        hooks and records removed, every parameter left empty."""
        if self._closed:
            return
        self._closed = True
        try:
            for i in list(self.inflight):
                self._drop_inflight(i)
            self._drop_grads_inflight()
            self.held.clear()
            for i in list(self.live):
                self._drop_grad(i)
                self._release_storage(i)
            self.live.clear()
            self.used = 0
        finally:
            self._unhook()
