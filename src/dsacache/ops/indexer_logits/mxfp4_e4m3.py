"""MXFP4 keys as e4m3, the decode every indexer-logits kernel shares (Triton and Gluon).

Hopper has no fp4 tensor cores, so MXFP4 keys become e4m3 in registers, exactly, with the
per-32 group scales folded in, and a key tile is one K = head_dim fp8 product as for FP8
keys. An e2m1 value ``v`` of a group with scale byte ``s_g`` is written as the e4m3 number
``v * 2**(s_g - s_max + 6)`` (``s_max``: the token's largest scale byte), which e4m3 holds
exactly for ``t = s_g - s_max + 11 >= 0``; the token then carries the single scale
``2**(s_max - 133)``, applied after the head sum (a positive power of two commutes with
``relu``). A group with ``t < 0``, more than 2**11 below its token's largest group, is
dropped: its products are under 2**-9 of the largest group's (the reference keeps them).

On CUDA the nibble -> byte rewrite is a byte-permute table lookup (``prmt``): two tables a
group, four values an instruction (:func:`group_tables_ptx`, :func:`table_lookup_ptx`). The
interpreter and other backends run the same math in plain integer ops
(:func:`nibble_to_e4m3`), which is also the statement the PTX is tested against.

The table decode reads the packed values as 32-bit words and leaves each thread's values in
the order they were packed, which permutes the key columns (:func:`table_columns`); the
queries are read in the same permuted order, so the dot products are unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsacache.dispatch import interpreting
from dsacache.formats.key_format import MXFP4_GROUP_SIZE

#: The inline-PTX decode needs a compiled NVIDIA kernel.
PTX_AVAILABLE = not interpreting() and torch.version.hip is None

#: Values a scale group; a group's 16 packed bytes are four 32-bit words.
GROUP = tl.constexpr(MXFP4_GROUP_SIZE)

#: Group offset byte marking a dropped group (``t < 0``); otherwise the byte is ``8 * t``.
DROPPED_GROUP = tl.constexpr(0x80)


@triton.jit
def nibble_to_e4m3(code, offset):
    """One e2m1 code (int32 0..15) and its group offset byte -> e4m3 byte (int32), plain ops."""
    mag = code & 7
    base = tl.where(mag == 1, 8, 4 * mag + 8)
    byte = tl.where(mag == 0, 0, base + offset) | ((code & 8) << 4)
    return tl.where(offset >= DROPPED_GROUP, 0, byte)


@triton.jit
def table_columns(col, G: tl.constexpr):
    """Key element held by each column ``col`` of a table-decoded tile of ``G`` groups.

    Word w (8 codes) of group g gives two 4-byte registers, its low and high half s, stored
    as columns ``((2 w + s) G + g) 4 + j``. Plain arithmetic, so Gluon kernels call it too.
    """
    j = col % 4
    g = (col // 4) % G
    s = (col // (4 * G)) % 2
    w = col // (8 * G)
    return 32 * g + 8 * w + 4 * s + j


# Per group, two prmt tables: bytes 0..7 of (pl, ph) are the e4m3 codes of the magnitudes
# 0, 0.5, 1, 1.5 | 2, 3, 4, 6 times 2**(t - 5) (the offset 8 t of `nibble_to_e4m3` added to
# the nonzero codes once a group), and (nl, nh) hold (that byte | 0x80) >> 1 in reverse order
# (byte 7 - m for magnitude m); a dropped group gets all-zero tables. The table math repeats in
# every word of a group; ptxas computes it once. Per value, the selector nibbles are the codes
# themselves: bits 0-2 pick a table byte and bit 3, the sign, makes prmt replicate that byte's
# msb (0 here) instead. So `pos` holds the magnitudes of the positive codes and 0 for the
# negative ones. The second lookup takes the complemented codes, 15 - code a nibble: bit 3 is
# clear exactly for the negative codes, and bits 0-2 are 7 - magnitude, hence the reversed
# table. pos + 2 neg is the signed byte (every magnitude is a multiple of 4, so nothing is lost
# by the halving, and -0 stays 0x80 as in `nibble_to_e4m3`). The complement of the low 16 bits
# is 0xFFFF - selector, no borrow, so it can run as an integer multiply-add on the FMA pipe
# instead of a logic op on the ALU pipe, which the lookups keep busy (docs/benchmarks.md).
def _group_table_words_ptx(t: str) -> str:
    """PTX: a kept group's four prmt tables (pl, ph, nl, nh) from its t in operand ``t``."""
    return f"""mad.lo.s32 pl, {t}, 0x08080800, 0x14100800;
mad.lo.s32 ph, {t}, 0x08080808, 0x24201C18;
mad.lo.s32 nl, {t}, 0x04040404, 0x4C4E5052;
mad.lo.s32 nh, {t}, 0x00040404, 0x4044484A;
"""


def group_tables_ptx(t: str) -> str:
    """PTX that builds a group's four prmt tables (pl, ph, nl, nh; all zero for a dropped
    group) from its t in operand ``t``."""
    return f"setp.ge.s32 kept, {t}, 0;\n" + _group_table_words_ptx(t) + """
selp.b32 pl, pl, 0, kept;
selp.b32 ph, ph, 0, kept;
selp.b32 nl, nl, 0, kept;
selp.b32 nh, nh, 0, kept;
"""


# The same tables with a dropped group zeroed by a multiply instead of a predicate and four
# selects: t >= -244 (a scale byte is at most 255 below its token's largest), so (t + 256) >> 8
# is 1 for a kept group and 0 for a dropped one. With the 1 of `t * one` an operand ptxas cannot
# see, the add and the four products are IMADs (FMA pipe); one shift a group stays on the ALU
# pipe instead of a compare and four SELs. It costs registers where a loop holds two pages.
def group_tables_flag_ptx(t: str, one: str) -> str:
    """PTX that builds the tables of :func:`group_tables_ptx` from the group's t in operand ``t``,
    a dropped group's zeroed by a 0/1 multiply; operand ``one`` must hold 1."""
    flag = f"mad.lo.s32 flag, {t}, {one}, 256;\nshr.u32 flag, flag, 8;\n"
    return flag + _group_table_words_ptx(t) + """
mul.lo.u32 pl, pl, flag;
mul.lo.u32 ph, ph, flag;
mul.lo.u32 nl, nl, flag;
mul.lo.u32 nh, nh, flag;
"""


def table_decode_ptx(body: str) -> str:
    """An inline-asm block declaring the registers of the table decode around ``body``, which
    builds the tables (:func:`group_tables_ptx`) and looks values up (:func:`table_lookup_ptx`)."""
    return """
{
.reg .pred kept;
.reg .b32 pl, ph, nl, nh, sel, flip, pos, neg, flag;
""" + body + "}\n"


def table_lookup_ptx(out: str, sel: str) -> str:
    """PTX: the four signed e4m3 bytes of the codes selected by ``sel`` (flip: the complement of
    ``sel``'s low 16 bits) from the group's tables, into ``out``."""
    return f"""prmt.b32 pos, pl, ph, {sel};
prmt.b32 neg, nl, nh, flip;
shl.b32 neg, neg, 1;
add.u32 {out}, pos, neg;
"""


#: One packed word decoded, 9 instructions for 8 values. $0/$1: e4m3 bytes of codes 0-3 / 4-7
#: of the word $2 (code i in bits 4i..4i+3, low nibble first as stored); $6: the group's t
#: (< 0: dropped). pack=4 hands each input over as four copies (one per output byte), only
#: the first is read.
WORD_DECODE_ASM = tl.constexpr(table_decode_ptx(
    group_tables_ptx("$6") + "not.b32 flip, $2;\n" + table_lookup_ptx("$0", "$2")
    + "shr.u32 sel, $2, 16;\nshr.u32 flip, flip, 16;\n" + table_lookup_ptx("$1", "sel")))
