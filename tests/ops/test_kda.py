"""KDA on the pool's state rows: the short conv (Triton kernel and its twin) and fla-core's
recurrence, decode and prefill, against whole-sequence references.

References: the conv over a whole sequence is ``F.conv1d`` (causal padding, one group a
channel); the recurrence over a whole sequence is fla-core's ``naive_recurrent_kda``. On CPU
the recurrence runs fla-core's naive references (``impl="torch"``); its recurrent Triton kernel
runs under the interpreter only from Triton 3.9 (skipped otherwise), its chunked kernel only on
CUDA (``test_kda_gpu.py``).

Tolerances: conv outputs in bf16 within one bf16 step (the Triton 3.6 interpreter truncates
fp32 to bf16 where torch and the GPU round to nearest), conv states bit-exact (bf16 inputs are
stored as they are); recurrence in fp32 within 1e-5 of the whole-sequence reference.
"""

import pytest
import torch
import torch.nn.functional as F

from dsacache.ops.kda import causal_conv1d_prefill_indexed, causal_conv1d_update_indexed, kda_decode, kda_prefill
from dsacache.planner import CacheConfig, SpeculativeConfig, plan
from dsacache.runtime import CachePool, RowAllocator, build_kda_metadata
from tests.helpers import TINY_HYBRID, run_compiled_script, triton_available

fla_naive = pytest.importorskip("fla.ops.kda.naive")

SENTINEL = 0xA5
W = 4  # conv width
H, D = 2, 16  # heads, head dim of the op-level tests
TOL = 1e-5
TINY = TINY_HYBRID


def tiny_pool(num_rows=8, num_spec=0):
    spec = SpeculativeConfig.from_json({"method": "ngram", "num_speculative_tokens": num_spec}) if num_spec else None
    config = CacheConfig.from_config_dict(TINY, tensor_parallel_size=1, speculative=spec)
    pool = CachePool(plan(config, num_rows=num_rows))
    pool._allocation.fill_(SENTINEL)
    return pool


def conv_reference(x, weight, bias=None, silu=True):
    """Causal depthwise conv over a whole sequence ``[T, C]`` (fp32)."""
    y = F.conv1d(x.float().T[None], weight.float()[:, None, :], bias, padding=weight.shape[1] - 1,
                 groups=x.shape[1])[0, :, : x.shape[0]].T
    return F.silu(y) if silu else y


def l2(x):
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def recurrent_reference(q, k, v, g, beta, initial=None):
    """(outputs [T, H, V], final state [H, K, V]) of the whole sequence, q/k L2-normalized."""
    o, s = fla_naive.naive_recurrent_kda(l2(q)[None], l2(k)[None], v[None].float(), g[None].float(),
                                         beta[None].float(), initial_state=initial, output_final_state=True)
    return o[0], s[0]


def kda_inputs(num_tokens, heads=H, dim=D, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(num_tokens, heads, dim, generator=gen) for _ in range(3))
    g = F.logsigmoid(torch.randn(num_tokens, heads, dim, generator=gen)) * 0.3
    beta = torch.rand(num_tokens, heads, generator=gen)
    return q, k, v, g, beta


def conv_params(channels, seed=1, bias=True):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(channels, W, generator=gen) * 0.5
    return weight, (torch.randn(channels, generator=gen) * 0.1 if bias else None)


def bf16_close(out, ref):
    out, ref = out.float(), ref.float()
    assert torch.isfinite(out).all()
    assert ((out - ref).abs() <= ref.abs() * 2 ** -7 + 1e-6).all(), (out - ref).abs().max()


IMPLS = ["torch", pytest.param("triton", marks=pytest.mark.interpret)]


def prefill_conv(x_parts, states, index, weight, bias, impl):
    """Run the conv prefill of one request chunk by chunk; return the outputs."""
    outs = []
    for i, part in enumerate(x_parts):
        qsl = torch.tensor([0, part.shape[0]], dtype=torch.int32)
        out = torch.full_like(part, float("nan"))
        causal_conv1d_prefill_indexed(part, states, torch.tensor([index], dtype=torch.int32), weight, bias,
                                      query_start_loc=qsl, has_initial_state=torch.tensor([i > 0]), out=out,
                                      impl=impl)
        outs.append(out)
    return torch.cat(outs)


# --- conv ---------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("chunks", [[1], [2], [3], [70], [63, 1], [2, 1, 64], [64, 65]])
def test_conv_prefill_chunks_then_decode_match_one_causal_conv(impl, chunks):
    channels, steps = 40, 3
    weight, bias = conv_params(channels)
    total = sum(chunks) + steps
    x = torch.randn(total, channels).bfloat16()
    states = torch.randn(5, W - 1, channels).bfloat16()  # garbage: a first chunk must not read it
    before = states.clone()
    parts = list(torch.split(x[: sum(chunks)], chunks))
    outs = [prefill_conv(parts, states, 3, weight, bias, impl)]
    for t in range(sum(chunks), total):
        out = torch.full((1, channels), float("nan"), dtype=torch.bfloat16)
        causal_conv1d_update_indexed(x[t : t + 1], states, torch.tensor([3], dtype=torch.int32), weight, bias,
                                     out=out, impl=impl)
        outs.append(out)
    bf16_close(torch.cat(outs), conv_reference(x, weight, bias))
    assert torch.equal(states[3], x[-(W - 1):])
    assert torch.equal(states[torch.arange(5) != 3], before[torch.arange(5) != 3])


@pytest.mark.parametrize("impl", IMPLS)
def test_conv_ragged_prefill_batch_and_padding(impl):
    channels = 300  # two channel blocks, the second partial
    weight, bias = conv_params(channels, bias=False)
    lens = [5, 0, 70, 2]
    x = torch.randn(sum(lens), channels).bfloat16()
    qsl = torch.tensor([0, 5, 5, 75, 77], dtype=torch.int32)
    states = torch.randn(6, W - 1 + 2, channels).bfloat16()
    history = torch.randn(W - 1, channels).bfloat16()
    states[4, : W - 1] = history
    before = states.clone()
    index = torch.tensor([1, 2, -1, 4], dtype=torch.int32)
    out = torch.full_like(x, float("nan"))
    causal_conv1d_prefill_indexed(x, states, index, weight, None, query_start_loc=qsl,
                                  has_initial_state=torch.tensor([False, False, False, True]), out=out, impl=impl)
    bf16_close(out[:5], conv_reference(x[:5], weight))
    assert torch.isnan(out[5:75].float()).all()  # the -1 request: outputs left unwritten
    bf16_close(out[75:], conv_reference(torch.cat([history, x[75:]]), weight)[W - 1:])
    assert torch.equal(states[1, : W - 1], x[5 - (W - 1) : 5])
    assert torch.equal(states[2, : W - 1], torch.zeros(W - 1, channels).bfloat16())  # empty new request
    assert torch.equal(states[4, : W - 1], torch.cat([history[-1:], x[75:]]))
    untouched = torch.ones_like(states, dtype=torch.bool)
    untouched[[1, 2, 4], : W - 1] = False
    assert torch.equal(states[untouched], before[untouched])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("accepted", [[3, 1, 2], [1, 1, 1], [3, 3, 3]])
def test_conv_speculative_steps_match_the_accepted_tokens(impl, accepted):
    """Three steps of next_n = 3 (2 drafts): the outputs of accepted tokens and the history the
    next step reads equal the conv over the accepted tokens alone."""
    channels, num_spec, next_n, prompt = 40, 2, 3, 6
    weight, bias = conv_params(channels)
    states = torch.randn(4, W - 1 + num_spec, channels).bfloat16()
    index = torch.tensor([2, -1], dtype=torch.int32)  # a padded second entry
    before = states.clone()
    prompt_x = torch.randn(prompt, channels).bfloat16()
    prefill_conv([prompt_x], states, 2, weight, bias, impl)
    true_inputs, outputs = [prompt_x], []
    last_accepted = 1
    for a in accepted:
        x = torch.randn(2 * next_n, channels).bfloat16()
        out = torch.full_like(x, float("nan"))
        causal_conv1d_update_indexed(x, states, index, weight, bias, next_n=next_n, out=out,
                                     num_accepted_tokens=torch.tensor([last_accepted, 1], dtype=torch.int32),
                                     impl=impl)
        assert torch.isnan(out[next_n:].float()).all()
        true_inputs.append(x[:a])
        outputs.append(out[:a])
        last_accepted = a
    seq = torch.cat(true_inputs)
    bf16_close(torch.cat(outputs), conv_reference(seq, weight, bias)[prompt:])
    history = states[2, last_accepted - 1 : last_accepted - 1 + W - 1]
    assert torch.equal(history, seq[-(W - 1):])
    assert torch.equal(states[[0, 1, 3]], before[[0, 1, 3]])


@pytest.mark.interpret
def test_conv_triton_twin_on_random_batches():
    channels, next_n = 96, 2
    weight, bias = conv_params(channels)
    states = torch.randn(9, W - 1 + 1, channels).bfloat16()
    index = torch.tensor([7, -1, 0, 4, 9, 3], dtype=torch.int32)  # 9 is past the states: skipped unchecked
    accepted = torch.tensor([1, 2, 2, 1, 1, 2], dtype=torch.int32)
    x = torch.randn(6 * next_n, channels).bfloat16()
    results = []
    for impl, idx in (("torch", torch.where(index > 8, -1, index).to(torch.int32)), ("triton", index)):
        s = states.clone()
        out = torch.full_like(x, float("nan"))
        causal_conv1d_update_indexed(x, s, idx, weight, bias, next_n=next_n, num_accepted_tokens=accepted,
                                     out=out, impl=impl, check_indices=impl == "torch")
        results.append((out, s))
    (ref_out, ref_states), (out, s) = results
    live = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.bool).repeat_interleave(next_n)
    bf16_close(out[live], ref_out[live])
    assert torch.isnan(out[~live].float()).all()
    assert torch.equal(s, ref_states)


@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_conv_kernel_builds_for_hopper():
    """Decode (fused state update), prefill outputs and the prefill state update compile for sm_90
    (ptxas ships with Triton), in a fresh interpreter: this one may run Triton interpreted."""
    script = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dsacache.ops.kda.conv import conv_indexed_kernel as kernel

signature = {"x_ptr": "*bf16", "stride_x": "i32", "out_ptr": "*bf16", "stride_o": "i32", "state_ptr": "*bf16",
             "stride_n": "i64", "stride_r": "i32", "index_ptr": "*i32", "accepted_ptr": "*i32", "initial_ptr": "*i1",
             "query_start_ptr": "*i32", "weight_ptr": "*fp32", "stride_wc": "i32", "stride_ww": "i32",
             "bias_ptr": "*fp32", "C": "i32", "num_states": "i32"}
for mode in ("decode", "prefill out", "prefill state"):
    decode = mode == "decode"
    constants = dict(NEXT_N=2 if decode else 0, W=4, KEEP_DRAFTS=decode, HAS_ACCEPTED=decode,
                     HAS_INITIAL=not decode, HAS_BIAS=True, SILU=True, WRITE_OUT=mode != "prefill state",
                     WRITE_STATE=mode != "prefill out", BLOCK_T=2 if decode else 64, BLOCK_S=4, BLOCK_C=256)
    sig = dict(signature, **{name: "constexpr" for name in constants})
    compiled = triton.compile(ASTSource(kernel, sig, constants), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4})
    assert compiled.asm["cubin"]
print("built")
"""
    assert "built" in run_compiled_script(script)


def test_conv_refusals_write_nothing():
    channels = 8
    weight, _ = conv_params(channels, bias=False)
    states = torch.zeros(3, W - 1, channels, dtype=torch.bfloat16)
    x = torch.randn(2, channels).bfloat16()
    idx = torch.tensor([0, 1], dtype=torch.int32)
    bad = [
        dict(state_indices=torch.tensor([0, 3], dtype=torch.int32)),  # past the states
        dict(state_indices=torch.tensor([1, 1], dtype=torch.int32)),  # one state twice
        dict(state_indices=torch.tensor([0, -2], dtype=torch.int32)),
        dict(state_indices=idx.long()),
        dict(weight=weight[:, :1]),  # width 1
        dict(weight=weight[:4]),
        dict(x=x.T.contiguous().T),  # channels not contiguous
        dict(activation="gelu"),
        dict(next_n=2),  # 2 requests x 2 tokens need 4 rows of x
        dict(num_accepted_tokens=torch.tensor([1, 2], dtype=torch.int32)),  # R = W - 1 allows a = 1 only
        dict(out=x),  # overlaps x
        dict(impl="cuda"),
    ]
    for change in bad:
        args = dict(x=x, conv_states=states, state_indices=idx, weight=weight) | change
        with pytest.raises(ValueError):
            causal_conv1d_update_indexed(**args)
        assert not states.any()
    with pytest.raises(ValueError, match="needs 5"):  # next_n = 3 needs W - 2 + 3 rows
        causal_conv1d_update_indexed(torch.randn(6, channels), states, idx, weight, next_n=3)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    for change in (dict(query_start_loc=torch.tensor([0, 2, 1], dtype=torch.int32)),
                   dict(query_start_loc=torch.tensor([0, 1, 3], dtype=torch.int32)),
                   dict(has_initial_state=torch.tensor([1, 0]))):
        args = dict(query_start_loc=qsl, has_initial_state=torch.tensor([False, True])) | change
        with pytest.raises(ValueError):
            causal_conv1d_prefill_indexed(x, states, idx, weight, **args)
        assert not states.any()


# --- recurrence -----------------------------------------------------------------------------


def run_prefill(parts, states, index):
    outs, has_state = [], False
    for q, k, v, g, beta in parts:
        n = q.shape[0]
        out = torch.full_like(v, float("nan"))
        kda_prefill(q, k, v, g, beta, states, torch.tensor([index], dtype=torch.int32),
                    cu_seqlens=torch.tensor([0, n], dtype=torch.int32), has_initial_state=torch.tensor([has_state]),
                    use_qk_l2norm_in_kernel=True, out=out, impl="torch")
        outs.append(out)
        has_state = True
    return outs


@pytest.mark.parametrize("chunks", [[1], [64], [65], [63, 1, 64], [130]])
def test_prefill_chunks_then_decodes_match_the_whole_recurrence(chunks):
    steps = 4
    total = sum(chunks) + steps
    q, k, v, g, beta = kda_inputs(total)
    states = torch.full((4, H, D, D), float("nan"))  # a new request must not read its old bytes
    edges = [0]
    for n in chunks:
        edges.append(edges[-1] + n)
    parts = [tuple(t[a:b] for t in (q, k, v, g, beta)) for a, b in zip(edges, edges[1:])]
    outs = run_prefill(parts, states, 2)
    index = torch.tensor([2, -1], dtype=torch.int32)  # a padded entry beside the request
    for t in range(sum(chunks), total):
        step = [torch.stack([x[t], x[t]])[:, None] for x in (q, k, v, g, beta)]
        out = torch.full_like(step[2], float("nan"))
        kda_decode(*step, states, index, use_qk_l2norm_in_kernel=True, out=out, impl="torch")
        assert torch.isnan(out[1]).all()
        outs.append(out[0])
    ref_out, ref_state = recurrent_reference(q, k, v, g, beta)
    assert (torch.cat(outs) - ref_out).abs().max() < TOL
    assert (states[2] - ref_state).abs().max() < TOL
    assert torch.isnan(states[[0, 1, 3]]).all()


def test_speculative_decode_with_partial_acceptance_matches_the_accepted_tokens():
    """next_n = 3: the state after token i goes to row i of the request's three; the next step
    starts from the row of the last accepted token."""
    next_n, prompt = 3, 5
    q, k, v, g, beta = kda_inputs(prompt + 3 * next_n, seed=3)
    states = torch.full((8, H, D, D), float("nan"))
    rows = torch.tensor([[6, 1, 3], [-1, -1, -1]], dtype=torch.int32)
    run_prefill([tuple(t[:prompt] for t in (q, k, v, g, beta))], states, 6)
    kept, outputs, last, pos = list(range(prompt)), [], 1, prompt
    for a in (2, 1, 3):
        sl = slice(pos, pos + next_n)
        step = [torch.stack([x[sl], x[sl]]) for x in (q, k, v, g, beta)]
        out = torch.full_like(step[2], float("nan"))
        kda_decode(*step, states, rows, num_accepted_tokens=torch.tensor([last, 1], dtype=torch.int32),
                   use_qk_l2norm_in_kernel=True, out=out, impl="torch")
        assert torch.isnan(out[1]).all()
        kept += list(range(pos, pos + a))
        outputs.append(out[0, :a])
        last, pos = a, pos + next_n
    idx = torch.tensor(kept)
    ref_out, ref_state = recurrent_reference(*(t[idx] for t in (q, k, v, g, beta)))
    assert (torch.cat(outputs) - ref_out[prompt:]).abs().max() < TOL
    assert (states[rows[0, last - 1]] - ref_state).abs().max() < TOL
    assert torch.isnan(states[[0, 2, 4, 5, 7]]).all()


def test_ragged_prefill_batch_skips_padding():
    lens = [3, 0, 66]
    q, k, v, g, beta = kda_inputs(sum(lens), seed=5)
    states = torch.full((5, H, D, D), float("nan"))
    initial = torch.randn(H, D, D) * 0.1
    states[0] = initial
    out = torch.full_like(v, float("nan"))
    cu = torch.tensor([0, 3, 3, 69], dtype=torch.int32)
    kda_prefill(q, k, v, g, beta, states, torch.tensor([0, 4, -1], dtype=torch.int32), cu_seqlens=cu,
                has_initial_state=torch.tensor([True, False, False]), use_qk_l2norm_in_kernel=True, out=out,
                impl="torch")
    ref_out, ref_state = recurrent_reference(*(t[:3] for t in (q, k, v, g, beta)), initial=initial[None])
    assert (out[:3] - ref_out).abs().max() < TOL and (states[0] - ref_state).abs().max() < TOL
    assert torch.equal(states[4], torch.zeros(H, D, D))  # no tokens: the zero state of a new request
    assert torch.isnan(out[3:]).all() and torch.isnan(states[[1, 2, 3]]).all()


def _fla_interpreter_runs():
    import triton

    return tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 9)


@pytest.mark.interpret
def test_fla_recurrent_kernel_on_cpu_needs_triton_3_9():
    q, k, v, g, beta = (t[None] for t in kda_inputs(1))
    states = torch.zeros(2, H, D, D)
    idx = torch.tensor([1], dtype=torch.int32)
    if not _fla_interpreter_runs():
        with pytest.raises(NotImplementedError, match="interpreter"):
            kda_decode(q, k, v, g, beta, states, idx, impl="triton")
        assert not states.any()
        pytest.skip("fla-core's recurrent kernel needs the Triton >= 3.9 interpreter on CPU (refusal checked)")
    ref = states.clone()
    out = kda_decode(q, k, v, g, beta, states, idx, impl="triton")
    ref_out = kda_decode(q, k, v, g, beta, ref, idx, impl="torch")
    assert (out - ref_out).abs().max() < TOL and (states - ref).abs().max() < TOL


def test_recurrent_refusals_write_nothing():
    q, k, v, g, beta = (t[None] for t in kda_inputs(1))
    states = torch.zeros(3, H, D, D)
    idx = torch.tensor([0], dtype=torch.int32)
    bad = [
        dict(state_indices=torch.tensor([3], dtype=torch.int32)),
        dict(state_indices=torch.tensor([[0, 1]], dtype=torch.int32)),  # next_n is 1
        dict(recurrent_states=states.double()),
        dict(recurrent_states=states.transpose(2, 3)),  # V first is not offered
        dict(g=g[..., :8]),
        dict(q=q.transpose(2, 3).contiguous().transpose(2, 3)),
        dict(scale=0.0),
        dict(num_accepted_tokens=torch.tensor([2], dtype=torch.int32)),
        dict(out=torch.empty(1, 1, H, D, dtype=torch.bfloat16)),
    ]
    for change in bad:
        args = dict(q=q, k=k, v=v, g=g, beta=beta, recurrent_states=states, state_indices=idx) | change
        with pytest.raises(ValueError):
            kda_decode(**args)
        assert not states.any()
    step = [torch.cat([t, t], dim=1) for t in (q, k, v, g, beta)]
    with pytest.raises(ValueError, match="num_accepted_tokens"):
        kda_decode(*step, states, torch.tensor([[0, 1]], dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="CUDA"):
        kda_prefill(q[0], k[0], v[0], g[0], beta[0], states, idx, cu_seqlens=torch.tensor([0, 1]),
                    has_initial_state=torch.tensor([False]), impl="triton")
    assert not states.any()


# --- in the pool ----------------------------------------------------------------------------


def state_bytes_mask(pool, rows, layer):
    """bool over ``pool.buffer``: the bytes of ``layer``'s state in each of ``rows``."""
    mask = torch.zeros_like(pool.buffer, dtype=torch.bool)
    for row in rows:
        conv, recurrent = pool.state_tensors_at([row] * pool.layout.state_rows_per_request, layer)
        for t in (conv, recurrent):
            start = t.data_ptr() - pool.buffer.data_ptr()
            mask[start : start + t.numel() * t.element_size()] = True
    return mask


@pytest.mark.parametrize("impl", IMPLS)
def test_one_request_in_the_pool_matches_the_whole_sequence(impl):
    """Two prefill chunks and three decode steps of one KDA layer of a tiny K3.1-like model, the
    batch padded with a -1 entry: outputs and states match the whole-sequence references, and
    every other byte of the pool (and the guard row's neighbours) keeps the sentinel."""
    pool = tiny_pool()
    layer = 5
    pool.allocator.add("other", num_tokens=10)
    pool.allocator.add("a", num_tokens=70)
    rows = pool.allocator.state_rows("a")
    group = pool.kda_state_row_index(layer)
    conv_view, rec_view = pool.kda_state_views(layer)
    heads, dim = 4, 16
    channels = 3 * heads * dim
    weight, bias = conv_params(channels)
    chunks, steps = [40, 30], 3
    total = sum(chunks) + steps
    x = torch.randn(total, channels).bfloat16()
    q, k, v, g, beta = kda_inputs(total, heads, dim, seed=7)
    conv_outs, rec_outs, pos = [], [], 0
    for i, n in enumerate(chunks):
        meta = build_kda_metadata([rows], [n], [pos + n], num_decodes=0, num_rows=pool.layout.num_rows)
        index = meta.prefill_state_indices(group)
        out = torch.empty(n, channels, dtype=torch.bfloat16)
        causal_conv1d_prefill_indexed(x[pos : pos + n], conv_view, index, weight, bias,
                                      query_start_loc=meta.prefill_query_start_loc,
                                      has_initial_state=meta.has_initial_state, max_query_len=meta.max_prefill_len,
                                      out=out, impl=impl)
        conv_outs.append(out)
        rec_outs.append(kda_prefill(*(t[pos : pos + n] for t in (q, k, v, g, beta)), rec_view, index,
                                    cu_seqlens=meta.prefill_cu_seqlens, has_initial_state=meta.has_initial_state,
                                    use_qk_l2norm_in_kernel=True, impl="torch"))
        pos += n
    for _ in range(steps):
        meta = build_kda_metadata([rows, None], [1, 1], [pos + 1, 1], num_decodes=2)
        index = meta.decode_conv_indices(group)
        xs = torch.cat([x[pos : pos + 1], x[pos : pos + 1]])
        conv_outs.append(causal_conv1d_update_indexed(xs, conv_view, index, weight, bias, impl=impl)[:1])
        step = [torch.stack([t[pos], t[pos]])[:, None] for t in (q, k, v, g, beta)]
        rec_outs.append(kda_decode(*step, rec_view, meta.decode_state_indices(group), use_qk_l2norm_in_kernel=True,
                                   impl="torch")[0])
        pos += 1
    bf16_close(torch.cat(conv_outs), conv_reference(x, weight, bias))
    ref_out, ref_state = recurrent_reference(q, k, v, g, beta)
    assert (torch.cat(rec_outs) - ref_out).abs().max() < TOL
    conv, recurrent = pool.state_tensors("a", layer)
    assert torch.equal(conv[: W - 1], x[-(W - 1):])
    assert (recurrent - ref_state).abs().max() < TOL
    mask = state_bytes_mask(pool, [rows[group]], layer)
    conv_tail = conv[W - 1:]
    if conv_tail.numel():
        start = conv_tail.data_ptr() - pool.buffer.data_ptr()
        mask[start : start + conv_tail.numel() * 2] = False
    assert (pool.buffer[~mask] == SENTINEL).all()


def compute_prompt(pool, rid, x, qkv, weight, start, stops, layers):
    """Prefill ``rid`` from token ``start`` to the end in chunks ending at ``stops``, every layer in ``layers``."""
    rows = pool.allocator.state_rows(rid)
    edges = [start] + [p for p in stops if p > start] + [x.shape[0]]
    for a, b in zip(edges, edges[1:]):
        meta = build_kda_metadata([rows], [b - a], [b], num_decodes=0)
        for layer in layers:
            conv_view, rec_view = pool.kda_state_views(layer)
            index = meta.prefill_state_indices(pool.kda_state_row_index(layer))
            causal_conv1d_prefill_indexed(x[a:b], conv_view, index, weight, query_start_loc=meta.prefill_query_start_loc,
                                          has_initial_state=meta.has_initial_state, impl="torch")
            kda_prefill(*(t[a:b] for t in qkv), rec_view, index, cu_seqlens=meta.prefill_cu_seqlens,
                        has_initial_state=meta.has_initial_state, use_qk_l2norm_in_kernel=True, impl="torch")


def test_a_request_resumed_from_a_checkpoint_ends_in_the_states_of_a_full_prefill():
    """a computes its prompt and saves the checkpoint at its last full block; b, whose prompt
    continues a's, restores it and computes only its tail; c computes b's whole prompt without
    prefix reuse. b's and c's states agree in every KDA layer (two of them checked), and a's
    checkpoint equals a's states at the boundary."""
    pool = tiny_pool(num_rows=20)
    block = pool.layout.block_size
    layers = [1, 6]  # in the first and the last of a request's state rows
    channels = 3 * 4 * 16
    weight, _ = conv_params(channels)
    total = 2 * block + 60
    x = torch.randn(total, channels).bfloat16()
    qkv = kda_inputs(total, 4, 16, seed=9)
    ids = list(range(total))
    pool.allocator.add("a", ids[: 2 * block + 20])
    positions = pool.allocator.checkpoint_positions("a")
    assert positions == [2 * block]
    # the engine ends a prefill chunk at the checkpoint position and saves there
    compute_prompt(pool, "a", x[: 2 * block], [t[: 2 * block] for t in qkv], weight, 0, [block], layers)
    assert pool.allocator.save_checkpoint("a", 2 * block)
    pool.copy_state_rows(pool.allocator.pop_state_copies())
    boundary = {layer: [t.clone() for t in pool.state_tensors("a", layer)] for layer in layers}
    pool.allocator.free("a")

    pool.allocator.add("b", ids)
    assert pool.allocator.restored_tokens("b") == 2 * block
    pool.copy_state_rows(pool.allocator.pop_state_copies())
    for layer in layers:
        conv, recurrent = pool.state_tensors("b", layer)
        assert torch.equal(conv, boundary[layer][0]) and torch.equal(recurrent, boundary[layer][1])
    compute_prompt(pool, "b", x, qkv, weight, 2 * block, [], layers)

    plain = RowAllocator.from_layout(pool.layout, enable_prefix_reuse=False)
    other = CachePool(pool.layout, allocator=plain)
    other.allocator.add("c", num_tokens=total)
    compute_prompt(other, "c", x, qkv, weight, 0, [], layers)
    for layer in layers:
        (conv_b, rec_b), (conv_c, rec_c) = pool.state_tensors("b", layer), other.state_tensors("c", layer)
        assert torch.equal(conv_b[: W - 1], conv_c[: W - 1])
        assert (rec_b - rec_c).abs().max() < TOL
