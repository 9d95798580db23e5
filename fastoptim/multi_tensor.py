"""Grouping of tensors for one engine call, the flat buffers of states, and the tables a fused
kernel walks.

A bucket holds one device and one dtype. A fused kernel reads a :class:`PointerTable`: the data
pointers of every tensor by role, and a chunk plan that cuts all tensors into fixed-size chunks,
so threads share the work of many small tensors as evenly as that of one large one. The table is
built once and kept while the params and states stay the same tensors with the same storage; only
the gradients' pointers, which change whenever grads are set to None and recomputed, are
refreshed every step.
"""
import numpy as np
import torch

META = torch.device("meta")

ALIGNMENT = 64  # bytes: a cache line, and torch's CPU allocator's alignment
CHUNK_NUMEL = 1 << 15  # 128 KiB of fp32 per stream: large enough to amortise, small enough to balance
MIN_COLUMNS = 64  # a column chunk reads its rows in runs of at least 256 bytes of fp32
# On the CPU, a column chunk reads its rows twice (the sums, then the update) and is best as whole
# rows: strips of 64 to 1536 of GPT-2's 3072 columns made an sn step 1.7-2.9x slower than whole rows
# (short runs defeat the prefetchers and DRAM pages). Only tensors past this size are cut, so threads
# share them. A GPU program is one chunk: there, column chunks stay chunk-sized, for parallelism. Each
# backend says which it takes (its COLUMN_NUMEL).
CPU_COLUMN_CHUNK_NUMEL = 1 << 22


def buckets(params):
    """Indices of ``params`` grouped by (device, dtype), in first-seen order."""
    groups = {}
    for i, param in enumerate(params):
        groups.setdefault((param.device, param.dtype), []).append(i)
    return list(groups.values())


def pick(tensors, indices, leave=()):
    """``tensors`` (role to one tensor per param) of the params ``indices`` alone, in that order,
    without the roles in ``leave``."""
    return {role: [values[i] for i in indices] for role, values in tensors.items() if role not in leave}


def in_flat_buffer(tensor):
    """Whether ``tensor`` is a view of a flat buffer (a contiguous 1-d tensor), as gathered states are."""
    base = tensor._base
    return base is not None and base.dim() == 1 and base.is_contiguous()


def aligned_offset(offset, shape, dtype, alignment=ALIGNMENT):
    """Where a state of ``shape`` and ``dtype`` begins in its buffer at or after ``offset``: on an
    ``alignment``-byte boundary, by default ``ALIGNMENT``, as torch's allocator aligns a tensor of its
    own (vector loads and stores would otherwise straddle cache lines); a 0-d one (a step count)
    right there: no kernel walks it, and a group's counts stay one packed tensor."""
    align = max(1, alignment // dtype.itemsize) if len(shape) else 1
    return -(-offset // align) * align


class FlatStates:
    """Zeroed flat buffers for the states ``layouts`` describes (one dict per param: state key to
    (shape, dtype)), one buffer per key and dtype on ``device``, cut into a slot per state in the
    params' order. :meth:`take` moves a state into its slot. A fused step's native code then
    checks a few buffers instead of a tensor per state, and per-param step counts are one tensor."""

    def __init__(self, layouts, device):
        self.layouts, self.offsets, sizes = layouts, [], {}
        for layout in layouts:
            offsets = {}
            for key, (shape, dtype) in layout.items():
                offsets[key] = aligned_offset(sizes.get((key, dtype), 0), shape, dtype)
                sizes[key, dtype] = offsets[key] + torch.Size(shape).numel()
            self.offsets.append(offsets)
        self.buffers = {kind: torch.zeros(numel, dtype=kind[1], device=device) for kind, numel in sizes.items() if numel}
        self.device = torch.device(device)

    def take(self, index, key, tensor):
        """``tensor``, param ``index``'s state ``key``, copied into its slot: the view, with the
        tensor's shape and strides; or ``tensor`` itself where the slot was cut for another shape,
        dtype or device, or it is not a dense plain tensor (a DTensor, a complex one). A new state
        given as a "meta" tensor (its shape, strides and dtype) is its slot as it is, zeros, with no
        zeros made to copy in (they cost as much as the buffers: a second at GPT-2's size); where it
        has no slot, zeros on the buffers' device."""
        offset, layout = self.offsets[index].get(key), self.layouts[index].get(key)
        buffer = None if layout is None else self.buffers.get((key, layout[1]))
        if (buffer is None or (tensor.shape, tensor.dtype) != layout or tensor.device not in (buffer.device, META)
                or type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.is_complex() or not is_dense(tensor)):
            return torch.zeros_like(tensor, device=self.device) if tensor.is_meta else tensor
        view = buffer.as_strided(tensor.shape, tensor.stride(), offset)
        if not tensor.is_meta:
            view.copy_(tensor)
        return view


def gather_states(states):
    """Move the tensors of ``states`` (param state dicts, just loaded) into flat buffers (see
    :class:`FlatStates`), one key at a time, so that at most one key's states are held twice. A
    tensor already in a buffer, or the only one of its key, dtype and device, stays where it is."""
    for key in dict.fromkeys(key for state in states for key in state):
        holders = [state for state in states if isinstance(state.get(key), torch.Tensor) and state[key].numel()
                   and not in_flat_buffer(state[key])]
        for device in dict.fromkeys(state[key].device for state in holders):
            on_device = [state for state in holders if state[key].device == device]
            if len(on_device) < 2:
                continue
            flat = FlatStates([{key: (state[key].shape, state[key].dtype)} for state in on_device], device)
            for index, state in enumerate(on_device):
                state[key] = flat.take(index, key, state[key])


def is_dense(tensor):
    """Whether ``tensor``'s elements fill its storage span with no gaps or overlaps, in any order
    of dimensions (contiguous, channels_last, a transpose...), so it can be walked as a flat array."""
    if tensor.numel() == 0:
        return True
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(tensor.stride(), tensor.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def spans_disjoint(starts, nbytes):
    """Whether no two memory spans (``starts``: their first bytes' addresses, ``nbytes``: their
    lengths; int64 arrays) share a byte. Empty spans share none."""
    starts, nbytes = np.asarray(starts, dtype=np.int64), np.asarray(nbytes, dtype=np.int64)
    starts, ends = starts[nbytes > 0], (starts + nbytes)[nbytes > 0]
    order = np.argsort(starts)
    return bool((ends[order][:-1] <= starts[order][1:]).all())


def _span_bytes(tensor):
    """The bytes from ``tensor``'s first element to its last, as its strides reach (0 for no element)."""
    if tensor.is_contiguous():
        return tensor.nbytes
    return tensor.element_size() * (1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
                                    ) if tensor.numel() else 0


def disjoint(tensors):
    """Whether no two of ``tensors`` share a byte of memory (each one's span, from its first element
    to its last, as its strides reach)."""
    return spans_disjoint([t.data_ptr() for t in tensors], list(map(_span_bytes, tensors)))


def overlapping(tensors):
    """The pairs of positions (i, j), i < j, of ``tensors`` whose spans (see :func:`disjoint`) share a
    byte: one sweep over the spans by their first bytes."""
    pairs, reaching = [], []  # the spans seen whose ends lie past the next one's start: (end, position)
    for start, nbytes, i in sorted((t.data_ptr(), _span_bytes(t), i) for i, t in enumerate(tensors)):
        if nbytes:
            reaching = [(end, j) for end, j in reaching if end > start]
            pairs += [(min(i, j), max(i, j)) for _, j in reaching]
            reaching.append((start + nbytes, i))
    return pairs


def chunk_plan(numels, layouts=None, chunk_numel=CHUNK_NUMEL, blocks=None, column_numel=CHUNK_NUMEL,
               block_columns=False):
    """Rows (tensor, first element, element count, elements in all rows before) covering every
    tensor in chunks of about ``chunk_numel`` elements, and each tensor's first row (one more entry
    than tensors). The running count lets a kernel give each thread an equal share.

    A subset-norm tensor with layout (b, c) (``layouts``, one row per tensor; (1, 1) is dense) is cut
    into whole subsets: runs of rows of b elements when c is 1, else runs of columns, each b
    elements of the count, of about ``column_numel`` elements and at least ``MIN_COLUMNS`` wide.

    ``blocks`` (one per tensor; None: all 1) makes a tensor's chunks hold whole blocks of that many
    row-major elements, as its 8-bit states need: runs of blocks, runs of whole subsets of a whole
    number of blocks, or all columns (the rows of a column run are not whole blocks); with
    ``block_columns``, where its rows are whole blocks, runs of a whole number of blocks of columns
    (each row's part of the run is then whole blocks: a kernel that walks it row by row may take it)."""
    numels = np.asarray(numels, dtype=np.int64)
    if layouts is None:
        layouts = np.ones((len(numels), 2), dtype=np.int64)
    blocks = np.ones(len(numels), dtype=np.int64) if blocks is None else np.asarray(blocks, dtype=np.int64)
    # A chunk holds whole units of b elements: elements (dense), subsets (rows) or columns.
    unit, columns = layouts[:, 0], layouts[:, 1] > 1
    units = numels // unit
    per_chunk = np.maximum(np.where(columns, column_numel, chunk_numel) // unit, np.where(columns, MIN_COLUMNS, 1))
    whole_blocks = blocks // np.gcd(unit, blocks)  # units per block boundary
    block_runs = columns & (blocks > 1) & block_columns & (units % blocks == 0)  # columns in runs of blocks
    per_chunk = np.where(block_runs, -(-per_chunk // blocks) * blocks,
                         np.where(columns & (blocks > 1), np.maximum(units, 1),
                                  -(-per_chunk // whole_blocks) * whole_blocks))
    counts = -(-units // per_chunk)  # empty tensors get no chunk
    first_chunk = np.concatenate([[0], np.cumsum(counts)])
    tensor = np.repeat(np.arange(len(numels)), counts)
    start_unit = (np.arange(first_chunk[-1]) - first_chunk[tensor]) * per_chunk[tensor]
    count = np.minimum(per_chunk[tensor], units[tensor] - start_unit) * unit[tensor]
    start = start_unit * unit[tensor]
    before = np.cumsum(count) - count
    return np.ascontiguousarray(np.stack([tensor, start, count, before], axis=1), dtype=np.int64), first_chunk


def subset_layouts(tensors):
    """Each tensor's subset-norm layout (b, c), read from its (a, b, c) view beside a second moment of
    another shape (see fastoptim.states.subset_norm); (1, 1) for a dense one."""
    states = [ts for role, ts in tensors.items() if role not in ("param", "grad") and not role.endswith("_absmax")]
    layouts = [(param.shape[1], param.shape[2]) if any(ts[i].shape != param.shape for ts in states) else (1, 1)
               for i, param in enumerate(tensors["param"])]
    return np.array(layouts, dtype=np.int64).reshape(-1, 2)


def staged(values, device):
    """``values`` (a numpy array or a list of numbers) as a CPU tensor that a copy to ``device`` need
    not wait for: pinned for a GPU, so the copy is asynchronous (a copy from pageable memory waits
    until the stream has run everything before it, which stalls the host each step)."""
    tensor = torch.from_numpy(np.array(values))
    return tensor.pin_memory() if torch.device(device).type == "cuda" else tensor


def sent_to(values, device):
    """``values`` as a tensor on ``device``, sent from :func:`staged` memory."""
    return staged(values, device).to(device, non_blocking=True)


def _increment_version_takes_lists():
    """Whether ``torch._C._increment_version`` takes a list of tensors (torch 2.5 on; before, one
    tensor; from then on a bare tensor is iterated, one bump per element)."""
    try:
        torch._C._increment_version([torch.zeros(1)])
    except TypeError:
        return False
    return True


def _bump_each(tensors):
    for tensor in tensors:
        torch._C._increment_version(tensor)


# bump_versions(tensors): bump the version counters of ``tensors`` (a list) once each, as an in-place op
# would, so that autograd notices a saved tensor that a kernel changed behind torch's back; torch's own
# function where it takes a list (no Python frame: a bound step calls it twice)
bump_versions = torch._C._increment_version if _increment_version_takes_lists() else _bump_each


def data_pointers(tensors):
    """The tensors' data pointers (0 for None)."""
    return np.fromiter((0 if t is None else t.data_ptr() for t in tensors), dtype=np.int64, count=len(tensors))


class PointerTable:
    """The data pointers of a bucket's tensors, one row per role in ``roles`` order (a role the
    bucket lacks is a row of zeros, and so is a None entry), and the chunk plan over them. It does
    not keep the tensors alive: its owner must, and must drop it when one of them changes (the
    optimizer's step work does both, see ``GroupWork``). Grads are new every step, so their row is
    refreshed.

    ``layouts`` holds each tensor's subset-norm (b, c) and its ``state_formats`` entry (a kernel's
    code for the format of its states; None: all 0), or is None when all of it is (1, 1, 0).
    ``blocks``, ``column_numel`` and ``block_columns`` are passed on to :func:`chunk_plan`."""

    def __init__(self, tensors, roles, state_formats=None, blocks=None, column_numel=CHUNK_NUMEL,
                 block_columns=False):
        self.roles = roles
        self.dtype, self.device = tensors["param"][0].dtype, tensors["param"][0].device
        self.pointers = np.zeros((len(roles), len(tensors["param"])), dtype=np.int64)
        for row, role in enumerate(roles):
            if role in tensors:
                self.pointers[row] = data_pointers(tensors[role])
        subsets = subset_layouts(tensors)
        formats = np.zeros(len(subsets), dtype=np.int64) if state_formats is None else np.asarray(state_formats)
        self.layouts = np.ascontiguousarray(np.column_stack([subsets, formats]), dtype=np.int64)
        if not (subsets > 1).any() and not formats.any():
            self.layouts = None
        self.chunks, self.first_chunk = chunk_plan([t.numel() for t in tensors["param"]], subsets, blocks=blocks,
                                                   column_numel=column_numel, block_columns=block_columns)
        self.subsets = subsets
        self.on_device = None  # (pointers, work) as sent to the device, and the device tensors
        self.numbers = None  # the Triton engine's plain scalars as sent to the device: (values, tensor)

    def refresh_grads(self, grad_pointers):
        self.pointers[self.roles.index("grad")] = grad_pointers

    def device_tables(self, device):
        """The pointer table and a work table for the Triton kernels, as int64 tensors on ``device``.
        A work row is a chunk: tensor, first element, element count, subset-norm (b, c), and whether
        all the tensor's streams are 16-byte aligned (so full tiles may use 128-bit accesses). They
        are sent once, and again only when a pointer (a new grad's) or an alignment changed."""
        sent = self.on_device
        same_device = sent is not None and sent[2].device == torch.device(device)
        if same_device and np.array_equal(sent[0], self.pointers):  # nothing moved: most steps end here
            return sent[2], sent[3]
        aligned = (self.pointers % 16 == 0).all(axis=0)
        tensor = self.chunks[:, 0]
        work = np.column_stack([self.chunks[:, :3], self.subsets[tensor], aligned[tensor]]).astype(np.int64)
        if not same_device:
            self.on_device = (self.pointers.copy(), work, sent_to(self.pointers, device), sent_to(work, device))
        else:
            sent[0][:] = self.pointers
            sent[2].copy_(staged(self.pointers, device), non_blocking=True)
            if not np.array_equal(sent[1], work):
                sent[1][:] = work
                sent[3].copy_(staged(work, device), non_blocking=True)
        return self.on_device[2], self.on_device[3]
