"""Small pieces every Triton kernel module shares (importing this module needs triton)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dsacache.dispatch import interpreting

#: True when kernels run under the Triton interpreter (CPU tests, ``TRITON_INTERPRET=1``).
INTERPRET = tl.constexpr(interpreting())


@triton.jit
def loop_bound(n):
    """A runtime loop bound that ``range()`` accepts both compiled and interpreted.

    The interpreter keeps every scalar as a 1-element array, which NumPy >= 2 refuses to
    turn into an index; there the copy gets a 0-d array. Compiled kernels never see that branch.
    """
    n = n + 0
    if INTERPRET:
        n.handle.data = n.handle.data.reshape(())
    return n


@triton.jit
def block_table_page(bt_row, block, live, max_blocks, num_pages):
    """(page id, usable) of block ``block`` of one request's block-table row ``bt_row``.

    The rule of ``dsacache.runtime.block_table``: usable iff ``live``, ``0 <= block < max_blocks``
    and ``0 <= page < num_pages``. The entry is loaded only inside the table; an unusable block
    gives page ``-1``.
    """
    in_table = live & (block >= 0) & (block < max_blocks)
    page = tl.load(bt_row + block, mask=in_table, other=-1)
    ok = (page >= 0) & (page < num_pages)
    return tl.where(ok, page, -1), ok


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int | None:
    """Streaming multiprocessors of a CUDA device (None elsewhere: the interpreter runs programs
    one after another), for launchers that size persistent grids."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def l2_cache_bytes(device: torch.device) -> int | None:
    """L2 cache size of a CUDA device (None elsewhere), for launchers that pick a tiling by whether
    their inputs stay in L2."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).L2_cache_size


@functools.lru_cache(maxsize=None)
def dependent_launch(device: torch.device) -> bool:
    """Whether kernels on ``device`` may be launched with programmatic dependent launch (PDL):
    compiled CUDA, not ROCm or the interpreter, on Hopper (sm_90) or newer. Such a kernel starts
    while the kernel before it finishes and must run ``griddepcontrol.wait`` before it reads
    anything that kernel may have written."""
    if device.type != "cuda" or interpreting() or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


#: Shared memory the driver keeps back for each resident program (CTA) on sm_80 and newer.
RESERVED_SHARED_PER_PROGRAM = 1024


def programs_per_sm(n_regs: int, shared: int, num_warps: int, regs_per_sm: int, shared_per_sm: int,
                    threads_per_sm: int) -> int:
    """Programs of a kernel (``n_regs`` registers a thread, ``shared`` bytes of shared memory,
    ``num_warps`` warps) that an SM holds at once: the least of what its registers (allocated
    256 a warp at a time), its shared memory and its threads allow."""
    regs_per_warp = -(-n_regs * 32 // 256) * 256
    by_regs = regs_per_sm // max(regs_per_warp * num_warps, 1)
    by_shared = shared_per_sm // (shared + RESERVED_SHARED_PER_PROGRAM)
    return min(by_regs, by_shared, threads_per_sm // (32 * num_warps))


def resident_programs(compiled, device: torch.device) -> int | None:
    """Programs of a compiled kernel (``JITFunction.warmup``'s result) that the whole GPU holds
    at once, for launchers that size a grid to one wave; None where the device does not say."""
    props = torch.cuda.get_device_properties(device)
    limits = [getattr(props, name, None) for name in
              ("regs_per_multiprocessor", "shared_memory_per_multiprocessor", "max_threads_per_multi_processor")]
    if None in limits:
        return None
    compiled._init_handles()  # loads the binary: the register count is known from here
    per_sm = programs_per_sm(compiled.n_regs, compiled.metadata.shared, compiled.metadata.num_warps, *limits)
    return per_sm * sm_count(device)


def shared_buffer_offset(compiled, name: str) -> int:
    """Byte offset in shared memory of the buffer that a compiled Gluon kernel (``warmup``'s result) allocates
    with ``gl.allocate_shared_memory`` into the variable ``name``, for inline PTX that addresses it from
    ``global_smem``. Gluon gives no address of a buffer; the offset is the one Triton's shared-memory
    allocation pass assigns, found by running the passes that ``make_llir`` runs before it on the kernel's
    TTGIR. Raises ``RuntimeError`` if the buffer is not found."""
    import re
    import tempfile

    from triton._C.libtriton import ir, nvidia, passes
    from triton.backends.nvidia.compiler import get_ptx_version_from_options

    meta = compiled.metadata
    context = ir.context()
    ir.load_dialects(context)
    nvidia.load_dialects(context)
    with tempfile.NamedTemporaryFile("w", suffix=".ttgir") as source:
        source.write(compiled.asm["ttgir"])
        source.flush()
        module = ir.parse_mlir_module(source.name, context)
    manager = ir.pass_manager(context)
    passes.ttgpuir.add_combine_tensor_select_and_if(manager)
    passes.ttgpuir.add_allocate_warp_groups(manager)
    passes.convert.add_scf_to_cf(manager)
    passes.gluon.add_inliner(manager)
    nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(manager, meta.target.arch,
                                                          get_ptx_version_from_options(meta, meta.target.arch))
    manager.run(module, "shared_buffer_offset")
    found = re.findall(rf"%{re.escape(name)}\b[^\n]*ttg\.local_alloc[^\n]*allocation\.offset = (\d+)", str(module))
    if len(found) != 1:
        raise RuntimeError(f"shared buffer {name!r}: {len(found)} allocations found in the compiled kernel")
    return int(found[0])


def check_launch(condition: bool, what: str) -> None:
    """A launcher's precondition on strides/dtypes: ``ValueError`` naming it (asserts vanish under -O)."""
    if not condition:
        raise ValueError(f"kernel launch precondition failed: {what}")
