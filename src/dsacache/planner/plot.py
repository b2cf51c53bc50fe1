"""``dsacache plan --plot FILE.png``: draw a packed row and the capacity (needs matplotlib)."""

from __future__ import annotations

from pathlib import Path

from dsacache.config.model import ConfigError, show
from dsacache.planner.layout import CacheLayout
from dsacache.planner.report import gib

#: File formats ``--plot`` writes, chosen by the file's extension (matplotlib needs nothing more for these).
PLOT_FORMATS = ("png", "svg", "pdf")
_COLORS = {"mla": "#4C72B0", "index": "#DD8452", "draft": "#55A868", "state": "#8172B2", "empty": "#E5E5E5"}


def _import_pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'dsacache[plot]'") from None
    return plt


def _bar(ax, y: float, segments: list[tuple[float, float, str]], label: str) -> None:
    for start, width, kind in segments:
        ax.barh(y, width, left=start, color=_COLORS[kind], edgecolor="white", linewidth=0.3)
    ax.text(-0.01, y, label, ha="right", va="center", fontsize=8)


def _sub_row_segments(layout: CacheLayout) -> list[tuple[float, float, str]]:
    total, page, segs = layout.page_stride_bytes, layout.kernel_page_size, []
    for slot in layout.dsa_layers:
        segs.append((slot.mla_offset / total, page * slot.mla_entry_bytes / total, "mla"))
        if slot.index_entry_bytes:
            segs.append((slot.index_offset / total, page * slot.index_entry_bytes / total, "index"))
    for d in layout.draft_layers:
        segs.append((d.mla_offset / total, page * d.mla_entry_bytes / total, "draft"))
    return segs


def _state_row_segments(layout: CacheLayout, block_size: int) -> list[tuple[float, float, str]]:
    row = block_size * layout.row_bytes_per_token
    per = layout.state_bytes / row
    segs = [(i * per, per, "state") for i in range(layout.states_per_row)]
    used = layout.states_per_row * per
    return segs + [(used, 1 - used, "empty")]


def check_plot_path(path: str) -> str:
    """The format of ``path`` (its extension, one of :data:`PLOT_FORMATS`); refused before anything runs.

    The file is written at exactly ``path``: no extension is added, a directory is not a file name.
    """
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"--plot needs a file name such as plan.png, got {show(path)}")
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"--plot {path!r} is a directory; give a file name such as {str(target / 'plan.png')!r}")
    fmt = target.suffix[1:].lower()
    if fmt not in PLOT_FORMATS:
        raise ConfigError(f"--plot {path!r}: the extension picks the format; allowed: "
                          f"{', '.join('.' + f for f in PLOT_FORMATS)}")
    if not target.parent.is_dir():
        raise ConfigError(f"--plot {path!r}: directory {str(target.parent)!r} does not exist")
    return fmt


def plot_layout(layout: CacheLayout, summary: dict, path: str, not_drawn: list[int] = ()) -> None:
    """Write one 64-token sub-row, a state row (packed vs power of two) and capacity bars to ``path``.

    The figure shows one TP size (``layout``'s); ``not_drawn`` names the other TP sizes of the
    run, which the title then says are not drawn.
    """
    fmt = check_plot_path(path)
    plt = _import_pyplot()
    fig, (ax_row, ax_cap) = plt.subplots(2, 1, figsize=(11, 5.5), gridspec_kw={"height_ratios": [3, 2]})
    _bar(ax_row, 2, _sub_row_segments(layout), "64-token sub-row\n(one kernel page)")
    if layout.is_packed:
        _bar(ax_row, 1, _state_row_segments(layout, layout.block_size), f"state row\nblock {layout.block_size}")
        _bar(ax_row, 0, _state_row_segments(layout, layout.pow2_block_size),
             f"state row\nblock {layout.pow2_block_size} (pow2)")
    ax_row.set_xlim(0, 1)
    ax_row.set_yticks([])
    ax_row.set_xlabel("fraction of the row's bytes")
    skipped = f" (TP {', '.join(map(str, not_drawn))} not drawn)" if not_drawn else ""
    ax_row.set_title(f"{summary['model']}: {summary['kind']} layout, TP {summary['tensor_parallel_size']}{skipped}, "
                     f"row {summary['row_bytes_per_token']:,} B/token")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    ax_row.legend(handles, ["MLA page", "indexer page", "draft page", "KDA state", "empty"],
                  ncol=5, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    _plot_capacity(ax_cap, summary)
    fig.tight_layout()
    try:
        fig.savefig(path, format=fmt, dpi=120)
    except OSError as exc:
        raise ConfigError(f"--plot: cannot write {path}: {exc.strerror}") from None
    finally:
        plt.close(fig)


def _plot_capacity(ax, summary: dict) -> None:
    if summary["kind"] == "packed":
        names = [f"packed\nblock {summary['block_size']}"]
    else:
        names = [f"{summary['kind']}\n{summary['kernel_page_size']}-token pages"]
    values = [summary["max_concurrent_requests"]]
    if "pow2" in summary:
        names.append(f"power of two\nblock {summary['pow2']['block_size']}")
        values.append(summary["pow2"]["max_concurrent_requests"])
    ax.barh(names, values, color=["#4C72B0", "#C44E52"][: len(values)])
    for i, v in enumerate(values):
        ax.text(v, i, f" {v:,}", va="center", fontsize=9)
    ax.set_xlabel(f"requests of {summary['context_length']:,} tokens that fit at once "
                  f"({gib(summary['cache_memory_bytes'])} per GPU)")
