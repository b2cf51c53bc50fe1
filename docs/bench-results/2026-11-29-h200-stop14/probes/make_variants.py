"""Write probe copies of the MXFP4 store and decode kernel modules with parts of their e2m1 work
replaced by cheap stand-ins. Their bytes and logits are wrong: they exist to be timed.

    python3 make_variants.py OUT_DIR        # then PYTHONPATH=src:OUT_DIR python3 run_bounds.py

kstore_free_encode  the fused store's tile: group scale kept, e2m1 rounding and packing replaced
                    by an xor-sum of the raw fp32 bits
kstore_no_pack      the same tile with exact rounding, only the nibble packing replaced
kstore_free_all     every MXFP4 store kernel: rounding returns the magnitude's bits, packing is an
                    xor-sum (group scale and the saturating multiply kept)
gk_shift_only       the Gluon MXFP4 decode with each e4m3 half-word just the packed word shifted
                    (no tables, no lookups, no sign)
gk_pos_only         the same decode with the tables and the positive lookup, no sign path
"""
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), *[".."] * 4))
OPS = os.path.join(ROOT, "src", "dsacache", "ops")

FREE_ALL = '''

# Probe: e2m1 rounding and nibble packing replaced (the group scale and the saturating
# magnitude multiply stay); these later definitions win when the kernels compile.
@triton.jit
def _e2m1_code_bits(a, DOMAIN: tl.constexpr, EXACT: tl.constexpr, INTERPRET: tl.constexpr):
    return a.to(tl.int32, bitcast=True)


@triton.jit
def _pack_e2m1_words(v_even, v_odd, y_even, y_odd, INTERPRET: tl.constexpr):
    return tl.sum(v_even ^ v_odd, axis=3)
'''


def store_variants(out):
    src = open(os.path.join(OPS, "indexer_k_cache", "triton_kernels.py")).read()
    codes = "    exp, v_even, v_odd = _mxfp4_norm_codes(even, odd, True, INTERPRET, FINITE)\n"
    pack = "    words = _pack_e2m1_words(v_even, v_odd, even, odd, INTERPRET)                   # [G, BLOCK_T, 4]\n"
    assert src.count(codes) == 1 and src.count(pack) == 1, "the store tile changed: update the probe"
    free = src.replace(codes, "    exp, inv_scale = _mxfp4_scale(even, odd, INTERPRET, FINITE)\n").replace(
        pack, "    words = tl.sum(even.to(tl.int32, bitcast=True) ^ odd.to(tl.int32, bitcast=True), axis=3)\n")
    write(out, "kstore_free_encode", free)
    write(out, "kstore_no_pack", src.replace(pack, "    words = tl.sum(v_even ^ v_odd, axis=3)\n"))
    write(out, "kstore_free_all", src + FREE_ALL)


def decode_variants(out):
    src = open(os.path.join(OPS, "indexer_logits", "gluon_kernels.py")).read()
    start = src.index("_HALF_ASM = gl.constexpr(")
    end = src.index('""")\n', start) + len('""")\n')
    old = src[start:end]
    write(out, "gk_shift_only", src.replace(old, '_HALF_ASM = gl.constexpr("shr.u32 $0, $1, $5;")\n'))
    pos_only = ('_HALF_ASM = gl.constexpr("""\n{\n.reg .pred kept;\n.reg .b32 pl, ph, nl, nh, sel;\n"""'
                ' + group_tables_ptx("$9") + """shr.u32 sel, $1, $5;\nprmt.b32 $0, pl, ph, sel;\n}\n""")\n')
    write(out, "gk_pos_only", src.replace(old, pos_only))


def write(out, name, text):
    with open(os.path.join(out, name + ".py"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    store_variants(out)
    decode_variants(out)
    print(f"probe modules in {out}", file=sys.stderr)
