"""The MXFP4 -> e4m3 table decode is inline PTX that only runs on a GPU. This runs the
kernels' own asm text (the Triton kernel's whole-word decode and the Gluon kernel's half-word
ones, dropped groups zeroed by selects or by a multiply) through a small model of the PTX
instructions they use and checks it bit-exact against the plain-op decode (``nibble_to_e4m3``)
that the interpreter runs, for every byte value in every byte position of a word, every kept
group offset and dropped groups."""

import functools
import random
import sys

import pytest

pytest.importorskip("triton")

from dsacache.ops.indexer_logits.mxfp4_e4m3 import WORD_DECODE_ASM  # noqa: E402

M32 = 0xFFFFFFFF


def _text(asm):
    return asm.value if hasattr(asm, "value") else asm


ASM = _text(WORD_DECODE_ASM)


@functools.cache
def gluon_half_asm(flag=False):
    """The Gluon kernel's half-word decode: tables zeroed by selects, or by a multiply (``flag``)."""
    pytest.importorskip("triton.experimental.gluon")
    from dsacache.ops.indexer_logits.decode_gluon import _HALF_ASM, _HALF_FLAG_ASM

    return _text(_HALF_FLAG_ASM if flag else _HALF_ASM)


def prmt(a, b, c):
    """prmt.b32, default mode: bytes 0..7 of {b, a}; selector nibble bit 3 replicates the msb."""
    src = ((b & M32) << 32) | (a & M32)
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = (src >> (8 * (sel & 7))) & 0xFF
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0x00
        out |= byte << (8 * i)
    return out


def s32(x):
    x &= M32
    return x - (1 << 32) if x & 0x80000000 else x


OPS = {
    "setp.ge.s32": lambda v: s32(v[0]) >= s32(v[1]),
    "mad.lo.s32": lambda v: (s32(v[0]) * s32(v[1]) + s32(v[2])) & M32,
    "mad.lo.u32": lambda v: (v[0] * v[1] + v[2]) & M32,
    "mul.lo.u32": lambda v: (v[0] * v[1]) & M32,
    "not.b32": lambda v: ~v[0] & M32,
    "xor.b32": lambda v: v[0] ^ v[1],
    "prmt.b32": lambda v: prmt(*v),
    "shl.b32": lambda v: (v[0] << v[1]) & M32,
    "shr.u32": lambda v: v[0] >> v[1],
    "add.u32": lambda v: (v[0] + v[1]) & M32,
}


def run_asm(asm, regs):
    """Run ``asm`` on the operands ``regs`` (``{"$n": value}``); returns every register it set."""
    regs = {name: v & M32 for name, v in regs.items()}

    def value(token):
        return regs[token] if token in regs else int(token, 0) & M32

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *srcs = [x.strip() for x in args.split(",")]
        if op == "selp.b32":
            regs[dst] = value(srcs[0]) if regs[srcs[2]] else value(srcs[1])
        elif op in OPS:
            regs[dst] = OPS[op]([value(s) for s in srcs])
        else:
            raise AssertionError(f"PTX the model does not know: {line}")
    return regs


def word_decode(word, t):
    """The Triton kernel's decode of one word: (bytes of codes 0-3, of codes 4-7)."""
    regs = run_asm(ASM, {"$2": word, "$6": t})
    return regs["$0"], regs["$1"]


def half_decode(word, t, flag=False):
    """The Gluon kernel's decode of one word, a call a half: (low half, high half); its $13 is -1,
    and $17 (the multiply form's one) 1."""
    asm = gluon_half_asm(flag)
    return tuple(run_asm(asm, {"$1": word, "$5": shift, "$9": t, "$13": -1, "$17": 1})["$0"] for shift in (0, 16))


def half_flag_decode(word, t):
    return half_decode(word, t, flag=True)


def nibble_to_e4m3(code, offset):
    """``nibble_to_e4m3`` in plain ints (offset 8 t, or 0x80 for a dropped group)."""
    mag = code & 7
    base = 8 if mag == 1 else 4 * mag + 8
    byte = (0 if mag == 0 else base + offset) | ((code & 8) << 4)
    return 0 if offset >= 0x80 else byte


def check_word(word, t, decode=word_decode):
    lo, hi = decode(word, t)
    offset = 0x80 if t < 0 else 8 * t
    for half, got in enumerate((lo, hi)):
        for j in range(4):
            code = (word >> (4 * (4 * half + j))) & 0xF
            assert (got >> (8 * j)) & 0xFF == nibble_to_e4m3(code, offset), (hex(word), t, half, j)


@pytest.mark.parametrize("decode", [word_decode, half_decode, half_flag_decode],
                         ids=["triton_word", "gluon_half", "gluon_half_flag"])
@pytest.mark.parametrize("t", list(range(-3, 12)) + [-13, -244])
def test_table_asm_every_byte_in_every_position(t, decode):
    rng = random.Random(t)
    for pos in range(4):
        for value in range(256):
            filler = rng.getrandbits(32) & ~(0xFF << (8 * pos))
            check_word(filler | (value << (8 * pos)), t, decode)


def test_the_model_catches_a_wrong_table():
    global ASM
    saved = ASM
    ASM = ASM.replace("0x24201C18", "0x24201C1C")
    try:
        with pytest.raises(AssertionError):
            for value in range(256):
                check_word(value * 0x01010101, 0)
    finally:
        ASM = saved


def test_the_model_catches_a_table_in_the_wrong_order(monkeypatch):
    """The negative table is read with the complemented codes, so it must be stored reversed: the
    order of the sign-flip decode (a table in code order) gives wrong bytes."""
    asm = gluon_half_asm().replace("0x4C4E5052", "0x4A484440").replace("0x4044484A", "0x52504E4C")
    monkeypatch.setattr(sys.modules[__name__], "gluon_half_asm", lambda flag=False: asm)
    with pytest.raises(AssertionError):
        for value in range(256):
            check_word(value * 0x01010101, 3, half_decode)


def test_the_model_catches_a_flag_that_keeps_dropped_groups(monkeypatch):
    """The multiply form's flag must be 1 for every kept group and 0 for every dropped one: a shift
    by 9 instead of 8 zeroes kept groups too, and a bias of 512 keeps dropped ones down to t = -256."""
    right = gluon_half_asm(True)
    for wrong in (("shr.u32 flag, flag, 8", "shr.u32 flag, flag, 9"), ("256;", "512;")):
        asm = right.replace(*wrong)
        assert asm != right
        monkeypatch.setattr(sys.modules[__name__], "gluon_half_asm", lambda flag=False, asm=asm: asm)
        with pytest.raises(AssertionError):
            for t in (-1, -244, 0, 11):
                for value in range(256):
                    check_word(value * 0x01010101, t, half_flag_decode)
