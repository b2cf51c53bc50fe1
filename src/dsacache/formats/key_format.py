"""The indexer key format, defined once (pure Python, no torch).

A layer's indexer pages hold, per 64-token kernel page, every token's packed values
first and then every token's scale bytes (``docs/layout.md``, "A kernel page of indexer
keys"). Two formats exist:

* ``fp8``: ``head_dim`` e4m3 bytes, then one fp32 (power-of-two) scale: ``head_dim + 4`` B.
* ``mxfp4``: ``head_dim / 2`` bytes of e2m1 pairs, then one UE8M0 byte per 32 values:
  ``head_dim / 2 + head_dim / 32`` B; ``head_dim`` must be a multiple of 32.

:class:`IndexerKeyFormat` is the one place that knows the names a user may type
(``auto`` means FP8), the value/scale split and the head-dim rule. Ops take the format
from what the pool hands out: the width of a paged view's last dim and the key width
identify it (:meth:`IndexerKeyFormat.of_pages`), and a format string, when given, is
checked against the pages.
"""

from __future__ import annotations

from dataclasses import dataclass

#: What ``indexer_kv_dtype`` may say; ``auto`` is FP8.
INDEXER_KV_DTYPES = ("auto", "fp8", "mxfp4")

#: The stored formats.
KEY_FORMATS = ("fp8", "mxfp4")

#: Values per MXFP4 scale group; the scale is one UE8M0 byte.
MXFP4_GROUP_SIZE = 32

#: One fp32 scale per token for FP8 indexer keys (``ue8m0``: always a power of two).
FP8_SCALE_BYTES = 4


def resolve_indexer_kv_dtype(indexer_kv_dtype: str) -> str:
    """Map a user's ``indexer_kv_dtype`` to the stored format, ``"fp8"`` or ``"mxfp4"``.

    >>> resolve_indexer_kv_dtype("auto")
    'fp8'
    """
    if indexer_kv_dtype in ("auto", "fp8"):
        return "fp8"
    if indexer_kv_dtype == "mxfp4":
        return "mxfp4"
    raise ValueError(f"indexer_kv_dtype={indexer_kv_dtype!r} is not supported; allowed: {', '.join(INDEXER_KV_DTYPES)}")


@dataclass(frozen=True)
class IndexerKeyFormat:
    """One indexer key format at one key width: names the per-token byte split.

    >>> fmt = IndexerKeyFormat.of("mxfp4", 128)
    >>> fmt.value_bytes, fmt.scale_bytes, fmt.entry_bytes
    (64, 4, 68)
    """

    name: str  # "fp8" or "mxfp4"
    head_dim: int

    def __post_init__(self) -> None:
        if self.name not in KEY_FORMATS:
            raise ValueError(f"indexer key format {self.name!r}; allowed: {', '.join(KEY_FORMATS)}")
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim < 1:
            raise ValueError(f"index_head_dim={self.head_dim!r} must be a positive integer")
        if self.name == "mxfp4" and self.head_dim % MXFP4_GROUP_SIZE:
            raise ValueError(
                f"index_head_dim={self.head_dim} must be a multiple of {MXFP4_GROUP_SIZE} for indexer_kv_dtype='mxfp4'"
            )

    @classmethod
    def of(cls, indexer_kv_dtype: "str | IndexerKeyFormat", head_dim: int) -> "IndexerKeyFormat":
        """The format a user's ``indexer_kv_dtype`` (``auto``/``fp8``/``mxfp4``) names at ``head_dim``."""
        if isinstance(indexer_kv_dtype, IndexerKeyFormat):
            if indexer_kv_dtype.head_dim != head_dim:
                raise ValueError(f"indexer key format is for head_dim={indexer_kv_dtype.head_dim}, keys have {head_dim}")
            return indexer_kv_dtype
        if not isinstance(indexer_kv_dtype, str):
            raise ValueError(f"indexer_kv_dtype must be a string ({', '.join(INDEXER_KV_DTYPES)}), got {indexer_kv_dtype!r}")
        return cls(resolve_indexer_kv_dtype(indexer_kv_dtype), head_dim)

    @classmethod
    def of_entry(cls, entry_bytes: int, head_dim: int, indexer_kv_dtype: "str | IndexerKeyFormat | None" = None
                 ) -> "IndexerKeyFormat":
        """The format of pages whose per-token budget is ``entry_bytes``, for keys of ``head_dim``.

        With ``indexer_kv_dtype`` given, it is checked against the pages; without it, the
        entry width decides (the two formats never share a width at one ``head_dim``).
        """
        if indexer_kv_dtype is not None:
            fmt = cls.of(indexer_kv_dtype, head_dim)
            if fmt.entry_bytes != entry_bytes:
                raise ValueError(
                    f"indexer pages of {entry_bytes} B a token do not hold {fmt.name} keys of head_dim={head_dim} "
                    f"({fmt.entry_bytes} B a token); pass the pages and indexer_kv_dtype of the same layout"
                )
            return fmt
        for name in KEY_FORMATS:
            if _entry_bytes(name, head_dim) == entry_bytes:
                return cls(name, head_dim)
        widths = ", ".join(f"{_entry_bytes(n, head_dim)} ({n})" for n in KEY_FORMATS if _valid(n, head_dim))
        raise ValueError(
            f"indexer pages of {entry_bytes} B a token match no key format at head_dim={head_dim}; allowed widths: {widths}"
        )

    @property
    def value_bytes(self) -> int:
        """Packed value bytes of one token: ``head_dim`` (fp8) or ``head_dim / 2`` (mxfp4)."""
        return self.head_dim if self.name == "fp8" else self.head_dim // 2

    @property
    def scale_bytes(self) -> int:
        """Scale bytes of one token: 4 (one fp32) or ``head_dim / 32`` (UE8M0 bytes)."""
        return FP8_SCALE_BYTES if self.name == "fp8" else self.head_dim // MXFP4_GROUP_SIZE

    @property
    def entry_bytes(self) -> int:
        """Bytes one token takes in a page: values plus scales."""
        return self.value_bytes + self.scale_bytes

    @property
    def is_mxfp4(self) -> bool:
        """True for MXFP4 keys."""
        return self.name == "mxfp4"


def _valid(name: str, head_dim: int) -> bool:
    return name == "fp8" or head_dim % MXFP4_GROUP_SIZE == 0


def _entry_bytes(name: str, head_dim: int) -> int | None:
    if not _valid(name, head_dim):
        return None
    return IndexerKeyFormat(name, head_dim).entry_bytes


def indexer_entry_bytes(head_dim: int, indexer_kv_dtype: str) -> int:
    """Bytes one token's indexer key takes in a page (132 for FP8 at 128, 68 for MXFP4)."""
    return IndexerKeyFormat.of(indexer_kv_dtype, head_dim).entry_bytes
