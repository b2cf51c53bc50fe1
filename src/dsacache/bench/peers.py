"""The peers: other libraries' kernels for dsacache's ops, timed beside them (``--peers DIR``).

``DIR`` holds the kernels a user would otherwise run, unpacked from the vLLM wheel:

* ``dg.tar.xz``: the DeepGEMM Python package (paged MQA logits; JIT-compiles on first call,
  needs ``CUDA_HOME``, set to ``/usr/local/cuda`` when unset);
* ``vc.so.xz``: vLLM's op library, xz-compressed (the indexer key store and the persistent
  top-k);
* ``fmla.so``: FlashMLA's op library (sparse decode on ``fp8_ds_mla`` pages).

A file that is missing or fails to load makes its peers unavailable: :func:`load_peers` says
so in one line on stderr per peer, and the suites skip them. A suite builds a peer's call on
its own inputs after its own correctness check, checks the peer's output against the same
reference and times it with the suite's own timer (:func:`dsacache.bench.harness.time_graph`),
all in :func:`attach_peer`; a peer that fails or disagrees is reported on the row, never timed.
"""

from __future__ import annotations

import importlib
import lzma
import os
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Callable

import torch

from dsacache.bench.harness import BenchRow
from dsacache.formats.sizes import KERNEL_PAGE_SIZE, mla_entry_bytes

#: Bytes of the fp8_ds_mla entry FlashMLA's sparse decode reads (latent rank 512, rope 64): 656.
FP8_DS_MLA_ENTRY = mla_entry_bytes(512, 64, "fp8_ds_mla")
#: Bytes of the scratch buffer vLLM's persistent top-k takes (its caller owns it).
TOPK_WORKSPACE_BYTES = 1 << 20


class PeerUnsupported(ValueError):
    """A peer cannot run this case (a shape or setting its kernel does not take)."""


class Peer:
    """One peer kernel: what it is, whether it loaded, and its call on a suite's inputs.

    ``op`` is the loaded callable (a ``torch.ops`` op or a module function), or None with
    ``reason`` saying why. Subclasses define ``name``, ``pack_file`` and ``make_call``, which
    returns a no-argument callable for the timed window; it returns the peer's output.
    """

    name = ""
    pack_file = ""

    def __init__(self, op: object | None = None, reason: str = ""):
        if op is None and not reason:
            raise ValueError(f"{type(self).__name__}: give the loaded op or the reason it is missing")
        self.op = op
        self.reason = "" if op is not None else reason
        self.scratch = None  # the unpacked pack the op runs from (set by PeerSet), kept alive with it

    def available(self) -> bool:
        """True when the op loaded; otherwise ``reason`` says why not."""
        return self.op is not None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({'loaded' if self.available() else self.reason})"


def deepgemm_unsupported(heads: int, next_n: int, capability: tuple[int, int]) -> str | None:
    """Why DeepGEMM's paged logits cannot take this case on a device of ``capability``, or None.

    On SM90 its kernels exist for H in {32, 64} and next_n in {1, 2}.
    """
    if capability == (9, 0) and (heads not in (32, 64) or next_n not in (1, 2)):
        return f"H={heads}, next_n={next_n}: DeepGEMM on SM90 takes H 32 or 64 and next_n 1 or 2"
    return None


class DeepGemmLogits(Peer):
    """DeepGEMM ``fp8_fp4_paged_mqa_logits`` (FP8 keys), beside ``paged_decode_logits``.

    Its values past a row's length are not defined: compare only where the reference is finite.
    """

    name = "DeepGEMM fp8_fp4_paged_mqa_logits"
    pack_file = "dg.tar.xz"

    def make_call(self, q: torch.Tensor, weights: torch.Tensor, context_lens: torch.Tensor, pages: torch.Tensor,
                  block_table: torch.Tensor, max_model_len: int) -> Callable[[], torch.Tensor]:
        """The call on ``paged_decode_logits``' own arguments (FP8 pages ``[num_pages, 64, 132]``).

        ``context_lens`` may be ``[B]`` per-request lengths (expanded as ``paged_decode_logits``
        does) or ``[B, next_n]``. The schedule metadata is built here, outside the timed call:
        an engine builds it once a step for every layer. Returns ``[B * next_n, max_model_len]`` fp32.
        """
        from dsacache.ops.indexer_logits import per_row_context_lens

        _, next_n, heads, head_dim = q.shape
        if pages.shape[-1] != head_dim + 4:
            raise PeerUnsupported(f"entry of {pages.shape[-1]} bytes: DeepGEMM is given FP8 pages ({head_dim + 4} bytes)")
        if q.is_cuda:
            why = deepgemm_unsupported(heads, next_n, torch.cuda.get_device_capability(q.device))
            if why:
                raise PeerUnsupported(why)
        if context_lens.dim() == 1:
            context_lens = per_row_context_lens(context_lens, next_n)
        context_lens = context_lens.to(torch.int32).contiguous()
        kv = pages.unsqueeze(2)
        meta = self.op.get_paged_mqa_logits_metadata(context_lens, KERNEL_PAGE_SIZE, self.op.get_num_sms())
        logits = self.op.fp8_fp4_paged_mqa_logits

        def call():
            return logits((q, None), kv, weights, context_lens, block_table, meta, max_model_len)

        return call


class VllmKeyStore(Peer):
    """vLLM ``indexer_k_quant_and_cache`` (FP8, power-of-two scales), beside ``store_indexer_keys``.

    The op addresses page ``p`` at ``p * 64 * 132`` bytes from the cache's start (it reads no
    page stride), so it writes a contiguous cache of its own, not a packed pool's layer view.
    """

    name = "vLLM indexer_k_quant_and_cache"
    pack_file = "vc.so.xz"

    def make_call(self, k: torch.Tensor, slot_mapping: torch.Tensor, num_pages: int) -> Callable[[], torch.Tensor]:
        """Store ``k`` ``[N, 128]`` bf16 at ``slot_mapping`` ``[N]`` into a fresh contiguous cache
        ``[num_pages, 64, 132]`` uint8 (zeros); the call returns that cache."""
        head_dim = k.shape[1]
        if head_dim != 128:
            raise PeerUnsupported(f"head_dim={head_dim}: the peer store is timed at 128 (one scale a key)")
        cache = torch.zeros(num_pages, KERNEL_PAGE_SIZE, head_dim + 4, dtype=torch.uint8, device=k.device)
        slots = slot_mapping.to(torch.int64).contiguous()
        store = self.op

        def call():
            store(k, cache, slots, head_dim, "ue8m0")
            return cache

        return call


def _sorted_or_minus_one(idx: torch.Tensor, length: int) -> torch.Tensor:
    """Each row's positions ascending, entries outside ``[0, length)`` as -1 (first)."""
    idx = idx.long()
    return torch.where((idx >= 0) & (idx < length), idx, -1).sort(dim=1).values


def topk_agreement(peer_out: torch.Tensor, ref: torch.Tensor, logits: torch.Tensor) -> tuple[bool, str]:
    """Does a peer's top-k ``[R, k]`` (any order) pick what the reference ``ref`` ``[R, k]`` picks?

    Agrees when every row holds the same set of positions. Where sets differ, it still agrees
    if the values picked are the same multiset (another choice among tied logits: a valid
    top-k, said in the note); otherwise it disagrees and the note counts the rows.
    """
    length = logits.shape[1]
    got, want = _sorted_or_minus_one(peer_out, length), _sorted_or_minus_one(ref, length)
    differ = (got != want).any(dim=1)
    if not bool(differ.any()):
        return True, ""

    def values(idx):
        picked = logits.gather(1, idx.clamp(min=0))
        return torch.where(idx >= 0, picked, float("-inf")).sort(dim=1).values

    # The -1 slots must line up too (a short row yields fewer than k positions).
    same_values = ((got >= 0) == (want >= 0)).all(dim=1) & _equal_nan(values(got), values(want))
    rows, bad = int(differ.sum()), int((differ & ~same_values).sum())
    if bad:
        return False, f"{bad} of {peer_out.shape[0]} rows pick other values"
    return True, f"{rows} of {peer_out.shape[0]} rows pick other positions among tied logits"


def _equal_nan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row: equal, NaN matching NaN."""
    return ((a == b) | (a.isnan() & b.isnan())).all(dim=1)


class VllmTopk(Peer):
    """vLLM ``persistent_topk``, beside ``topk_indices``. Its positions come in no set order,
    and on tied logits its set can change from run to run (see :func:`topk_agreement`)."""

    name = "vLLM persistent_topk"
    pack_file = "vc.so.xz"

    def make_call(self, logits: torch.Tensor, seq_lens: torch.Tensor, k: int) -> Callable[[], torch.Tensor]:
        """Top-``k`` of ``logits`` ``[R, L]`` fp32 rows of lengths ``seq_lens`` ``[R]`` int32;
        the call returns ``[R, k]`` int32 positions."""
        if k not in (512, 1024, 2048):
            raise PeerUnsupported(f"k={k}: vLLM's persistent top-k takes k 512, 1024 or 2048")
        out = torch.empty(logits.shape[0], k, dtype=torch.int32, device=logits.device)
        workspace = torch.zeros(TOPK_WORKSPACE_BYTES, dtype=torch.uint8, device=logits.device)
        lens = seq_lens.to(torch.int32).contiguous()
        topk, length = self.op, logits.shape[1]

        def call():
            topk(logits, lens, out, workspace, k, length)
            return out

        return call


def flashmla_heads(heads: int) -> int:
    """Heads FlashMLA's sparse decode runs for ``heads`` query heads: 64 or 128 (pad with zeros)."""
    if heads < 1 or heads > 128:
        raise PeerUnsupported(f"H={heads}: FlashMLA's sparse decode takes up to 128 heads (run as 64 or 128)")
    return 64 if heads <= 64 else 128


class FlashMlaSparseDecode(Peer):
    """FlashMLA ``sparse_decode_fwd`` on 656-byte ``fp8_ds_mla`` entries, beside dsacache's sparse MLA."""

    name = "FlashMLA sparse_decode_fwd"
    pack_file = "fmla.so"

    def make_call(self, q: torch.Tensor, pages: torch.Tensor, indices: torch.Tensor,
                  softmax_scale: float) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """Sparse decode of ``q`` ``[B, s_q, H, 576]`` bf16 over ``pages`` ``[num_pages, 64, 656]``
        uint8 (any page stride) at ``indices`` ``[B, s_q, topk]`` int32 global slots (-1: none).

        Queries with fewer than 64 heads (or 65-127) are padded with zero heads once, outside
        the timed call, as a user must. The call returns ``(out [B, s_q, H, 512] bf16,
        lse [B, H, s_q] fp32)`` for the real heads.
        """
        batch, s_q, heads, dim = q.shape
        if pages.shape[2] != FP8_DS_MLA_ENTRY or pages.stride(1) != FP8_DS_MLA_ENTRY:
            raise PeerUnsupported(f"entries of {pages.shape[2]} bytes {pages.stride(1)} apart: FlashMLA reads "
                                  f"{FP8_DS_MLA_ENTRY}-byte fp8_ds_mla entries back to back")
        padded = flashmla_heads(heads)
        if padded != heads:
            q = torch.cat([q, q.new_zeros(batch, s_q, padded - heads, dim)], dim=2)
        kv = pages.unsqueeze(2)
        idx = indices.to(torch.int32).contiguous()
        decode = self.op

        def call():
            out, lse, _, _ = decode(q, kv, idx, None, None, None, None, None, None, None, 512, softmax_scale, None,
                                    False)
            return out[:, :, :heads], lse[:, :heads]

        return call


class PeerSet:
    """The peers loaded from one pack directory, by the suite that times them.

    Keys: ``"logits"`` (:class:`DeepGemmLogits`), ``"store"`` (:class:`VllmKeyStore`),
    ``"topk"`` (:class:`VllmTopk`), ``"sparse_mla"`` (:class:`FlashMlaSparseDecode`).
    The scratch directory the pack was unpacked into lives as long as the set or any peer
    taken from it: DeepGEMM compiles from the headers there at its first call, so a peer kept
    after its set (``load_peers(d).get("logits")``) would otherwise fail then, on a missing file.
    """

    def __init__(self, peers: dict[str, Peer], scratch: tempfile.TemporaryDirectory | None = None):
        self.peers = peers
        self._scratch = scratch
        for peer in peers.values():
            peer.scratch = scratch

    def get(self, key: str) -> Peer | None:
        """The peer for ``key`` when it loaded, else None."""
        peer = self.peers.get(key)
        return peer if peer is not None and peer.available() else None

    def summary(self) -> dict[str, str]:
        """Peer name -> ``"loaded"`` or why not (for the report's header)."""
        return {p.name: "loaded" if p.available() else p.reason for p in self.peers.values()}


def _first_line(exc: BaseException) -> str:
    """``Type: first line of the message``, and the cause's (a failed library load hides why in it)."""
    text = str(exc).strip().splitlines()
    line = f"{type(exc).__name__}: {text[0][:200] if text else ''}".rstrip(": ")
    return line if exc.__cause__ is None else f"{line} ({_first_line(exc.__cause__)})"


def _load_deep_gemm(path: Path, scratch: str):
    """Unpack the DeepGEMM package into ``scratch`` and import it from there."""
    with tarfile.open(path, "r:xz") as tar:
        tar.extractall(scratch, filter="data")
    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
    sys.path.insert(0, scratch)
    module = importlib.import_module("deep_gemm")
    for attr in ("get_paged_mqa_logits_metadata", "fp8_fp4_paged_mqa_logits", "get_num_sms"):
        getattr(module, attr)
    return module


def _load_library(path: Path, unpack_to: str | None = None) -> str:
    """Load an op library into ``torch.ops`` (xz-decompressed to ``unpack_to`` first when given);
    returns the path loaded."""
    target = str(path)
    if unpack_to is not None:
        with lzma.open(path) as src, open(unpack_to, "wb") as dst:
            shutil.copyfileobj(src, dst)
        target = unpack_to
    torch.ops.load_library(target)
    return target


def _attempt(fn: Callable[[], object]) -> tuple[object | None, str]:
    """``(result, "")``, or ``(None, why)`` when ``fn`` raises."""
    try:
        return fn(), ""
    except Exception as exc:  # any failure to load or resolve a peer is reported, and the peer skipped
        return None, _first_line(exc)


def _from_file(directory: Path, name: str, load: Callable[[Path], object]) -> tuple[object | None, str]:
    path = directory / name
    if not path.is_file():
        return None, f"{path} not found"
    result, why = _attempt(lambda: load(path))
    return result, (f"{path}: {why}" if why else "")


def load_peers(directory: str | os.PathLike) -> PeerSet:
    """Load every peer the pack in ``directory`` holds; one stderr line for each one that did not.

    Example::

        peers = load_peers(".peers")
        topk = peers.get("topk")        # None when vc.so.xz was missing or failed
    """
    directory = Path(directory)
    scratch = tempfile.TemporaryDirectory(prefix="dsacache-peers-")
    deep_gemm, dg_why = _from_file(directory, DeepGemmLogits.pack_file, lambda p: _load_deep_gemm(p, scratch.name))
    vllm, vc_why = _from_file(directory, VllmKeyStore.pack_file,
                              lambda p: _load_library(p, os.path.join(scratch.name, "vc.so")))
    flashmla, fmla_why = _from_file(directory, FlashMlaSparseDecode.pack_file, _load_library)
    peers = {"logits": DeepGemmLogits(deep_gemm, dg_why)}
    peers["store"] = _op_peer(VllmKeyStore, vllm, vc_why, lambda: torch.ops._C_cache_ops.indexer_k_quant_and_cache)
    peers["topk"] = _op_peer(VllmTopk, vllm, vc_why, lambda: torch.ops._C.persistent_topk)
    peers["sparse_mla"] = _op_peer(FlashMlaSparseDecode, flashmla, fmla_why,
                                   lambda: torch.ops._flashmla_C.sparse_decode_fwd)
    for peer in peers.values():
        if not peer.available():
            print(f"dsacache bench: peer {peer.name} skipped: {peer.reason}", file=sys.stderr)
    return PeerSet(peers, scratch)


def _op_peer(cls: type[Peer], library: object | None, why: str, resolve: Callable[[], object]) -> Peer:
    """The peer of one op of a loaded library (or unavailable with the library's reason)."""
    if library is None:
        return cls(None, why)
    op, op_why = _attempt(resolve)
    return cls(op, f"{cls.pack_file} loaded but has no such op ({op_why})" if op is None else "")


def peer_for(args, key: str) -> Peer | None:
    """The loaded peer ``key`` of a suite's ``args.peers`` (None without ``--peers`` or when it did not load)."""
    peer_set = getattr(args, "peers", None)
    return peer_set.get(key) if peer_set is not None else None


def attach_peer(row: BenchRow, peer: Peer | None, make_call: Callable[[], Callable[[], object]],
                agreement: Callable[[object], tuple[bool, str]],
                timer: Callable[[Callable[[], object]], float]) -> BenchRow:
    """Put ``peer``'s side on ``row``: build its call, check its output, time it the same way.

    ``make_call()`` builds the peer's call on the row's own inputs (``peer.make_call(...)``);
    its first run (outside the timing: DeepGEMM compiles then) gives the output that
    ``agreement(out) -> (agrees, note)`` judges against the suite's reference. ``timer`` is
    the one that timed the row (:func:`dsacache.bench.harness.time_graph`). A peer that cannot
    take the case, fails, or disagrees gets a note on the row and no time. Without ``peer``
    (not asked for, or not loaded) the row is returned as it is.
    """
    if peer is None:
        return row
    row.peer = peer.name
    try:
        call = make_call()
        out = call()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        agrees, note = agreement(out)
    except PeerUnsupported as exc:
        row.peer_note = f"not run: {exc}"
        return row
    except Exception as exc:  # a peer's failure is reported on its row; dsacache's side stands
        return _report(row, f"failed: {_first_line(exc)}")
    if not agrees:
        return _report(row, f"disagrees with the reference: {note}")
    try:
        row.peer_ms = timer(call)
    except Exception as exc:  # e.g. a peer that cannot be captured in a CUDA graph
        return _report(row, f"failed while timing: {_first_line(exc)}")
    row.peer_note = note or None
    return row


def _report(row: BenchRow, note: str) -> BenchRow:
    """Note on ``row`` why its peer has no time, and say it on stderr."""
    row.peer_note = note
    print(f"dsacache bench: peer {row.peer} on {row.op} {row.shape}: {note}", file=sys.stderr)
    return row
