"""Capacity and waste of a planned layout, as a JSON-ready dict and as readable text."""

from __future__ import annotations

import math

from dsacache.config.model import show
from dsacache.config.serving import MLA_DRAFT_METHODS, MXFP4_READERS, ConfigError
from dsacache.planner.layout import CacheLayout

#: Keys of ``dsacache plan --json`` that are a stable contract.
STABLE_KEYS = (
    "block_size", "states_per_row", "row_bytes_per_token", "index_bytes_per_token", "mla_bytes_per_token",
    "draft_bytes_per_token", "state_bytes", "indexer_kv_dtype", "num_rows", "token_capacity",
)


def request_bytes(layout: CacheLayout, context_length: int) -> int:
    """Pool bytes one request of ``context_length`` tokens needs on each rank (states included)."""
    if layout.is_packed:
        return layout.rows_per_request(context_length) * layout.row_bytes
    # A paged layout's rows are single kernel pages; its KDA states live beside the pool.
    pages = layout.attention_rows_for(context_length)
    return pages * layout.page_stride_bytes + layout.num_kda_layers * layout.state_bytes


def max_concurrent_requests(layout: CacheLayout, context_length: int) -> int:
    """How many requests of ``context_length`` tokens fit at once (each with its state rows);
    under DCP, on every rank of the group (each holds its share of every request)."""
    if layout.is_packed:
        return layout.num_rows // layout.rows_per_request(context_length)
    return layout.config.cache_memory_bytes // request_bytes(layout, context_length)


def waste(layout: CacheLayout, context_length: int) -> dict:
    """Empty bytes in a state row and in a request's attention rows (the last row's tail)."""
    rows = layout.attention_rows_for(context_length)
    tail_tokens = rows * layout.tokens_per_row - context_length
    states = layout.states_per_row * layout.state_bytes
    return {
        "state_row_empty_bytes": layout.row_bytes - states if layout.is_packed else None,
        "state_row_empty_fraction": round(1 - states / layout.row_bytes, 4) if layout.is_packed else None,
        "attention_tail_tokens": tail_tokens,
        "attention_empty_fraction": round(tail_tokens / (rows * layout.tokens_per_row), 4) if rows else 0.0,
    }


def _capacity(layout: CacheLayout, context_length: int) -> dict:
    return {
        "block_size": layout.block_size,
        "num_rows": layout.num_rows,
        "row_bytes": layout.row_bytes,
        "max_concurrent_requests": max_concurrent_requests(layout, context_length),
        **waste(layout, context_length),
    }


def summarize(layout: CacheLayout, context_length: int) -> dict:
    """Everything ``dsacache plan --json`` prints for one TP size."""
    if not isinstance(layout, CacheLayout):
        raise ConfigError(f"layout must be a CacheLayout (plan() builds one), got {type(layout).__name__}")
    if isinstance(context_length, bool) or not isinstance(context_length, int) or context_length < 1:
        raise ConfigError(f"context_length must be >= 1, got {show(context_length)}")
    config, packed = layout.config, layout.is_packed
    if context_length > layout.token_capacity:  # checked first: the sizes below grow with context_length
        _cannot_hold(layout, context_length, f"the pool holds {layout.token_capacity:,} tokens")
    fits = max_concurrent_requests(layout, context_length)
    if fits < 1:
        _cannot_hold(layout, context_length, f"it needs {request_bytes(layout, context_length):,} B")
    out = {
        "model": config.model.name,
        "kind": layout.kind,
        "block_size": layout.block_size if packed else None,
        "states_per_row": layout.states_per_row if packed else None,
        "row_bytes_per_token": layout.row_bytes_per_token,
        "index_bytes_per_token": layout.index_bytes_per_token,
        "mla_bytes_per_token": layout.mla_bytes_per_token,
        "draft_bytes_per_token": layout.draft_bytes_per_token,
        "state_bytes": layout.state_bytes,
        "indexer_kv_dtype": layout.indexer_kv_dtype,
        "num_rows": layout.num_rows,
        "token_capacity": layout.token_capacity,
        "tensor_parallel_size": config.tensor_parallel_size,
        "decode_context_parallel_size": config.decode_context_parallel_size,
        "reference_tp": layout.reference_tp,
        "kv_cache_dtype": config.kv_cache_dtype,
        "num_speculative_tokens": config.num_speculative_tokens,
        "num_dsa_layers": config.model.num_dsa_layers,
        "num_attention_layers": len(layout.dsa_layers),
        "num_kda_layers": layout.num_kda_layers,
        "num_draft_layers": len(layout.draft_layers),
        "conv_state_bytes": layout.state.conv_bytes if layout.state else 0,
        "recurrent_state_bytes": layout.state.recurrent_bytes if layout.state else 0,
        "state_rows_per_request": layout.state_rows_per_request,
        "kernel_page_size": layout.kernel_page_size,
        "pages_per_row": layout.pages_per_row,
        "page_stride_bytes": layout.page_stride_bytes,
        "row_bytes": layout.row_bytes,
        "cache_memory_bytes": config.cache_memory_bytes,
        "context_length": context_length,
        "attention_rows_per_request": layout.attention_rows_for(context_length),
        "max_concurrent_requests": fits,
        "mxfp4_readable_by": [b for b, archs in MXFP4_READERS.items() if config.target_arch in archs],
        "target_arch": config.target_arch,
        **waste(layout, context_length),
        "layout": _layout_dict(layout),
    }
    if packed:
        out["pow2"] = _capacity(layout.with_block_size(layout.pow2_block_size), context_length)
    out["notes"] = _notes(layout)
    return out


def _cannot_hold(layout: CacheLayout, context_length: int, why: str) -> None:
    raise ConfigError(
        f"the cache budget of {layout.config.cache_memory_bytes:,} B cannot hold one request of "
        f"{context_length} tokens ({why}); raise --kv-cache-memory-bytes or lower --context-length"
    )


def _notes(layout: CacheLayout) -> list[str]:
    """Settings the user may not expect to have no effect."""
    config, notes = layout.config, []
    spec = config.speculative
    if spec is not None and spec.method in MLA_DRAFT_METHODS and spec.draft is None:
        notes.append(f"speculative method {spec.method!r} without an MLA draft config (no 'model'/'draft_config' "
                     "with kv_lora_rank): no draft pages planned")
    if layout.is_packed and config.prefill_context_parallel_size > 1:
        notes.append(f"prefill_context_parallel_size={config.prefill_context_parallel_size}: the packed "
                     "runtime's step metadata refuses PCP (NotImplementedError); plan with 1 to serve it")
    if config.model.indexer is None and config.indexer_kv_dtype != "auto":
        notes.append(f"indexer_kv_dtype={config.indexer_kv_dtype!r} has no effect: the model has no indexer")
    return notes


def _layout_dict(layout: CacheLayout) -> dict:
    return {
        "attention_layers": [vars(s) for s in layout.dsa_layers],
        "draft_layers": [vars(s) for s in layout.draft_layers],
        "kda_layers": [vars(s) for s in layout.kda_layers],
    }


def exchange_table(layouts: list[CacheLayout]) -> list[dict]:
    """For each pair of TP sizes: can their blocks be exchanged (one block size divides the other)?"""
    rows = []
    for a in layouts:
        for b in layouts:
            if a is b:
                continue
            small, large = sorted((a.block_size, b.block_size))
            rows.append({"tp": a.config.tensor_parallel_size, "other_tp": b.config.tensor_parallel_size,
                         "exchangeable": large % small == 0})
    return rows


def gib(nbytes: int) -> str:
    """Bytes in binary units, as ``dsacache simulate`` prints them too (``"45.96 GiB"``)."""
    return f"{nbytes / 2**30:.2f} GiB"


def _kib(nbytes: int) -> str:
    return f"{nbytes:,} B ({nbytes / 1024:.1f} KiB)"


def render_text(summary: dict) -> str:
    """A readable report of :func:`summarize`'s dict."""
    s = summary
    lines = [
        f"dsacache plan: {s['model']}  ({s['kind']} layout, TP {s['tensor_parallel_size']}, "
        f"reference TP {s['reference_tp']}, {s['kv_cache_dtype']} MLA, "
        f"{(s['indexer_kv_dtype'] + ' indexer keys') if s['num_dsa_layers'] else 'no indexer'}, "
        f"{s['num_speculative_tokens']} speculative tokens)",
        "",
        "Per-token bytes",
        f"  MLA latent   {s['mla_bytes_per_token']:>8,} B x {s['num_attention_layers']} layers",
        f"  indexer key  {s['index_bytes_per_token']:>8,} B x {s['num_dsa_layers']} layers",
        f"  draft MLA    {s['draft_bytes_per_token']:>8,} B ({s['num_draft_layers']} layers)",
        f"  row          {s['row_bytes_per_token']:>8,} B",
        "",
        "KDA state per layer per rank",
        f"  conv {_kib(s['conv_state_bytes'])} + recurrent {_kib(s['recurrent_state_bytes'])} "
        f"= {_kib(s['state_bytes'])}  ({s['num_kda_layers']} KDA layers)",
    ]
    lines += _packed_lines(s) if s["kind"] == "packed" else _paged_lines(s)
    lines += ["", "MXFP4 indexer keys on " + s["target_arch"] + ": readable by "
              + (", ".join(s["mxfp4_readable_by"]) or "no backend")]
    lines += [f"note: {note}" for note in s["notes"]]
    return "\n".join(lines)


def _packed_lines(s: dict) -> list[str]:
    p2 = s["pow2"]
    lines = [
        f"  states per row {s['states_per_row']}, state rows per request {s['state_rows_per_request']}",
        "",
        "Packed block row",
        f"  block size {s['block_size']} tokens = {s['pages_per_row']} kernel pages of {s['kernel_page_size']}",
        f"  row {s['row_bytes'] / 2**20:.2f} MiB, page stride {s['page_stride_bytes']:,} B",
        "",
        *_sub_row_lines(s),
        "",
        f"Capacity (budget {gib(s['cache_memory_bytes'])} = {s['cache_memory_bytes']:,} B per GPU)",
        f"  rows {s['num_rows']:,}, token capacity {s['token_capacity']:,}",
        f"  requests of {s['context_length']:,} tokens at once: {s['max_concurrent_requests']:,} "
        f"({s['state_rows_per_request']} state rows + "
        f"{s['attention_rows_per_request']} attention rows each{_dcp_share(s)})",
        "",
        f"Waste                         packed ({s['block_size']:>5})   power of two ({p2['block_size']:>5})",
        f"  state row left empty        {s['state_row_empty_fraction']:>14.1%}   {p2['state_row_empty_fraction']:>19.1%}",
        f"  last attention row, empty   {s['attention_tail_tokens']:>7} tokens   {p2['attention_tail_tokens']:>12} tokens",
        f"  requests that fit           {s['max_concurrent_requests']:>14,}   {p2['max_concurrent_requests']:>19,}",
    ]
    return lines


def _dcp_share(s: dict) -> str:
    """Under DCP a row covers ``dcp x block_size`` tokens of a request (each rank holds its share)."""
    dcp = s["decode_context_parallel_size"]
    if dcp == 1:
        return ""
    return f"; DCP {dcp}: a row covers {dcp * s['block_size']:,} tokens, each rank storing its share"


def _sub_row_lines(s: dict) -> list[str]:
    """Where each layer's pages sit inside one 64-token sub-row (kernel page)."""
    att, drafts = s["layout"]["attention_layers"], s["layout"]["draft_layers"]
    lines = ["Kernel page (64-token sub-row j of row r = kernel page r * pages_per_row + j):",
             "  layer   MLA page @ offset      indexer page @ offset"]
    shown = att if len(att) <= 6 else att[:3] + [None] + att[-2:]
    for slot in shown:
        if slot is None:
            lines.append("  ...")
            continue
        lines.append(f"  {slot['layer']:>5}   {slot['mla_offset']:>12,} B        {slot['index_offset']:>12,} B")
    for d in drafts:
        lines.append(f"  draft{d['index']}  {d['mla_offset']:>12,} B")
    lines.append(f"  state row: {s['states_per_row']} states of {s['state_bytes']:,} B from offset 0 "
                 "(conv state, then recurrent state)")
    return lines


def _paged_lines(s: dict) -> list[str]:
    return [
        "",
        "Paged layout (not a KDA-hybrid DSA model: no packed block size)",
        f"  rows are {s['kernel_page_size']}-token pages of {s['page_stride_bytes']:,} B (every attention layer)",
        "",
        f"Capacity (budget {gib(s['cache_memory_bytes'])} = {s['cache_memory_bytes']:,} B per GPU)",
        f"  pages {s['num_rows']:,}, token capacity {s['token_capacity']:,}",
        f"  requests of {s['context_length']:,} tokens at once: {s['max_concurrent_requests']:,}"
        + (" (KDA states kept beside the pages)" if s["num_kda_layers"] else ""),
    ]


def render_tp_table(summaries: list[dict], exchange: list[dict]) -> str:
    """Block size per TP size and which pairs can exchange blocks."""
    lines = ["TP   reference TP   block size   state bytes/rank   rows   requests"]
    for s in summaries:
        block = s["block_size"] if s["block_size"] is not None else "-"
        lines.append(f"{s['tensor_parallel_size']:<4} {s['reference_tp']:>12}   {block:>10}   "
                     f"{s['state_bytes']:>16,}   {s['num_rows']:>5,}   {s['max_concurrent_requests']:>8,}")
    if summaries and summaries[0]["block_size"] is not None:
        tps = [s["tensor_parallel_size"] for s in summaries]
        ok = {(e["tp"], e["other_tp"]): e["exchangeable"] for e in exchange}
        lines += ["", "Can exchange blocks (one block size divides the other):",
                  "     " + "".join(f"{t:>6}" for t in tps)]
        for a in tps:
            cells = "".join(f"{'-' if a == b else ('yes' if ok[(a, b)] else 'no'):>6}" for b in tps)
            lines.append(f"{a:<5}{cells}")
        if not all(e["exchangeable"] for e in exchange):
            lcm = math.lcm(*tps)
            lines.append(f"\nTP sizes that do not divide the reference TP get their own reference; "
                         f"--reference-tp {lcm} makes every pair exchangeable.")
    return "\n".join(lines)
