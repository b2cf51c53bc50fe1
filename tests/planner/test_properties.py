"""Property tests over random valid KDA-hybrid DSA configs (hypothesis).

The oracle is ``docs/planning.md`` restated independently below (``_spec_*``); the
properties are the ones the spec promises: the row holds its states, rounding waste
stays under one alignment unit at the reference TP, and block sizes at TP sizes
dividing the reference TP divide each other.
"""

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsacache import CacheConfig, SpeculativeConfig, plan

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HEADS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96)
KV_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_ds_mla")


@st.composite
def raw_configs(draw):
    """A random KDA-hybrid DSA ``config.json`` dict (layer numbers shuffled)."""
    num_dsa = draw(st.integers(1, 12))
    num_kda = draw(st.integers(1, 60))
    order = draw(st.permutations(range(1, num_dsa + num_kda + 1)))
    raw = {
        "num_hidden_layers": num_dsa + num_kda,
        "kv_lora_rank": draw(st.sampled_from((128, 256, 384, 512))),
        "qk_rope_head_dim": draw(st.sampled_from((0, 32, 64))),
        "linear_attn_config": {
            "kda_layers": list(order[num_dsa:]),
            "full_attn_layers": list(order[:num_dsa]),
            "num_heads": draw(st.sampled_from(HEADS)),
            "head_dim": draw(st.sampled_from((32, 64, 128, 256))),
            "short_conv_kernel_size": draw(st.integers(1, 6)),
        },
        "dsa_config": {
            "index_n_heads": draw(st.integers(1, 64)),
            "index_head_dim": draw(st.sampled_from((32, 64, 128, 256))),
            "index_topk": 2048,
            "index_k_norm_type": "layernorm",
            "index_rope_dim": 0,
        },
    }
    if draw(st.booleans()):
        raw = {"text_config": raw}
    return raw


@st.composite
def options(draw, heads):
    """Serving options valid for a model with ``heads`` KDA heads (TP divides the heads)."""
    tps = [d for d in range(1, min(heads, 32) + 1) if heads % d == 0]
    spec = None
    if draw(st.booleans()):
        spec = SpeculativeConfig(draw(st.sampled_from(("ngram", "mtp", "suffix"))), draw(st.integers(1, 7)))
    return dict(
        tensor_parallel_size=draw(st.sampled_from(tps)),
        kv_cache_dtype=draw(st.sampled_from(KV_DTYPES)),
        indexer_kv_dtype=draw(st.sampled_from(("auto", "fp8", "mxfp4"))),
        speculative=spec,
        alignment=draw(st.sampled_from((64, 128, 192))),
        reference_tp=draw(st.sampled_from((8, 8, 8, 4, 16))),
    )


def _text(raw):
    return raw.get("text_config", raw)


def _spec_mla(rank, rope, dtype):
    return {"auto": 2 * (rank + rope), "bfloat16": 2 * (rank + rope), "fp8": rank + rope,
            "fp8_e4m3": rank + rope, "fp8_ds_mla": rank + 4 * rank // 128 + 2 * rope}[dtype]


def _spec_numbers(raw, opts):
    """(row_bytes_per_token, state_bytes, states_per_row, total state bytes over all ranks) from the spec."""
    cfg = _text(raw)
    lin, dsa = cfg["linear_attn_config"], cfg["dsa_config"]
    d, s = len(lin["full_attn_layers"]), len(lin["kda_layers"])
    hd = dsa["index_head_dim"]
    index = hd + 4 if opts["indexer_kv_dtype"] in ("auto", "fp8") else hd // 2 + hd // 32
    row = d * (_spec_mla(cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], opts["kv_cache_dtype"]) + index)
    tp, n_spec = opts["tensor_parallel_size"], opts["speculative"].num_speculative_tokens if opts["speculative"] else 0
    h, k = lin["num_heads"], lin["head_dim"]
    state = (lin["short_conv_kernel_size"] - 1 + n_spec) * (3 * h * k // tp) * 2 + (h // tp) * k * k * 4
    per_row = math.ceil(s / math.ceil(s / d))
    return row, state, per_row, state * tp


@SETTINGS
@given(st.data())
def test_layout_matches_the_spec(data):
    raw = data.draw(raw_configs())
    opts = data.draw(options(_text(raw)["linear_attn_config"]["num_heads"]))
    layout = plan(CacheConfig.from_config_dict(raw, **opts))
    row, state, per_row, total = _spec_numbers(raw, opts)
    tp, align = opts["tensor_parallel_size"], opts["alignment"]
    reference = math.lcm(opts["reference_tp"], tp)
    units = math.ceil(per_row * total / (align * reference * row))
    assert layout.is_packed
    assert layout.row_bytes_per_token == row
    assert layout.state_bytes == state
    assert layout.states_per_row == per_row
    assert layout.reference_tp == reference
    assert layout.block_size == align * units * reference // tp


@SETTINGS
@given(st.data())
def test_block_holds_the_states_with_under_one_unit_of_waste(data):
    raw = data.draw(raw_configs())
    opts = data.draw(options(_text(raw)["linear_attn_config"]["num_heads"]))
    layout = plan(CacheConfig.from_config_dict(raw, **opts))
    tp, align = opts["tensor_parallel_size"], opts["alignment"]
    block, per_token = layout.block_size, layout.row_bytes_per_token
    assert block % align == 0 and block % 64 == 0
    # the row holds states_per_row states of this rank
    assert block * per_token >= layout.states_per_row * layout.state_bytes
    # at the reference TP the block is a whole number of units, one unit fewer would not hold the states
    assert (block * tp) % (layout.reference_tp * align) == 0
    block_at_reference = block * tp // layout.reference_tp
    states_at_reference = layout.states_per_row * layout.state_bytes * tp  # x 1 / reference_tp, kept exact
    assert block_at_reference * per_token * layout.reference_tp >= states_at_reference
    assert (block_at_reference - align) * per_token * layout.reference_tp < states_at_reference
    # every KDA layer gets a slot, in ceil(S / D) balanced rows of at most D states
    d, s = layout.config.model.num_dsa_layers, layout.num_kda_layers
    assert layout.states_per_row <= d
    assert layout.state_rows_per_request == math.ceil(s / d)
    slots = {(x.state_row, x.slot) for x in layout.kda_layers}
    assert len(slots) == s
    assert all(x.offset + layout.state_bytes <= layout.row_bytes for x in layout.kda_layers)


@SETTINGS
@given(st.data())
def test_block_sizes_divide_each_other_up_to_the_reference_tp(data):
    raw = data.draw(raw_configs())
    heads = _text(raw)["linear_attn_config"]["num_heads"]
    opts = data.draw(options(heads))
    reference = opts["reference_tp"]
    tps = [t for t in range(1, reference + 1) if reference % t == 0 and heads % t == 0]
    blocks = {}
    for tp in tps:
        layout = plan(CacheConfig.from_config_dict(raw, **{**opts, "tensor_parallel_size": tp}))
        assert layout.reference_tp == reference
        blocks[tp] = layout.block_size
    for a in tps:
        for b in tps:
            if b % a == 0:
                # the smaller TP has the larger block, by exactly the TP ratio
                assert blocks[a] == blocks[b] * (b // a)


@SETTINGS
@given(st.data())
def test_sub_row_offsets_tile_the_page_stride(data):
    raw = data.draw(raw_configs())
    opts = data.draw(options(_text(raw)["linear_attn_config"]["num_heads"]))
    layout = plan(CacheConfig.from_config_dict(raw, **opts))
    page = layout.kernel_page_size
    segs = sorted([(s.mla_offset, page * s.mla_entry_bytes) for s in layout.dsa_layers]
                  + [(s.index_offset, page * s.index_entry_bytes) for s in layout.dsa_layers])
    pos = 0
    for offset, size in segs:
        assert offset == pos
        pos += size
    assert pos == layout.page_stride_bytes
    assert sorted(s.layer for s in layout.dsa_layers) == sorted(_text(raw)["linear_attn_config"]["full_attn_layers"])
