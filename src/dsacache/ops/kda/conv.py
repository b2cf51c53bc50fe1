"""Triton kernel of the short causal convolution on indexed conv states (see ``naive.py`` for
the rule it implements, ``api.py`` for the public functions).

One program covers a block of tokens of one request and a block of channels. For each tap
it loads the shifted tile of the request's "extended input" (the history rows of its conv
state followed by this step's inputs) straight from memory, so no tile is shifted in
registers. Decode runs one token block a request and updates the state in the same program
after every load of it (the history is read before any row of it is overwritten); a prefill
runs the outputs first and the state update as a second launch, since its token blocks are
separate programs that all read the history.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _extended_tile(x_ptr, stride_x, bos, num_tokens, state_row_ptr, stride_r, first_row, has_state, e, cols,
                   col_mask, W: tl.constexpr):
    """fp32 ``[len(e), BLOCK_C]``: entry ``e`` of the extended input, zero outside it.

    ``e < W - 1`` is history row ``first_row + e`` of the state (zero without a state),
    ``e >= W - 1`` is input token ``e - (W - 1)`` of the request."""
    from_state = e < W - 1
    state_mask = from_state & (e >= 0) & has_state
    state_ptrs = state_row_ptr + (first_row + e).to(tl.int64)[:, None] * stride_r + cols[None, :]
    history = tl.load(state_ptrs, mask=state_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
    token = e - (W - 1)
    token_mask = (token >= 0) & (token < num_tokens)
    x_ptrs = x_ptr + (bos + token).to(tl.int64)[:, None] * stride_x + cols[None, :]
    inputs = tl.load(x_ptrs, mask=token_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
    return tl.where(from_state[:, None], history, inputs)


@triton.jit
def conv_indexed_kernel(
    x_ptr, stride_x, out_ptr, stride_o,
    state_ptr, stride_n, stride_r,
    index_ptr, accepted_ptr, initial_ptr, query_start_ptr,
    weight_ptr, stride_wc, stride_ww, bias_ptr,
    C, num_states,
    NEXT_N: tl.constexpr,  # decode: tokens a request; 0: ragged (query_start_ptr)
    W: tl.constexpr,
    KEEP_DRAFTS: tl.constexpr,  # keep the step's last NEXT_N - 1 inputs too (speculative decode)
    HAS_ACCEPTED: tl.constexpr,
    HAS_INITIAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    WRITE_OUT: tl.constexpr,
    WRITE_STATE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    b = tl.program_id(0)
    t0 = tl.program_id(1) * BLOCK_T
    index = tl.load(index_ptr + b).to(tl.int64)
    if (index < 0) | (index >= num_states):
        return
    if NEXT_N > 0:
        bos = b.to(tl.int64) * NEXT_N
        num_tokens = NEXT_N
    else:
        bos = tl.load(query_start_ptr + b).to(tl.int64)
        num_tokens = (tl.load(query_start_ptr + b + 1) - bos).to(tl.int32)
    if WRITE_OUT:
        if t0 >= num_tokens:
            return
    first_row = 0
    if HAS_ACCEPTED:
        first_row = tl.load(accepted_ptr + b) - 1
    has_state = index >= 0  # true here; a tensor, like the loaded flag
    if HAS_INITIAL:
        has_state = tl.load(initial_ptr + b) != 0
    state_row_ptr = state_ptr + index * stride_n
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < C

    if WRITE_OUT:
        t = t0 + tl.arange(0, BLOCK_T)
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for w in tl.static_range(W):
            tap = tl.load(weight_ptr + cols * stride_wc + w * stride_ww, mask=col_mask, other=0.0).to(tl.float32)
            tile = _extended_tile(x_ptr, stride_x, bos, num_tokens, state_row_ptr, stride_r, first_row, has_state,
                                  t + w, cols, col_mask, W)
            acc += tile * tap[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if SILU:
            acc = acc * tl.sigmoid(acc)
        out_ptrs = out_ptr + (bos + t).to(tl.int64)[:, None] * stride_o + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(t < num_tokens)[:, None] & col_mask[None, :])

    if WRITE_STATE:
        keep = W - 1
        if KEEP_DRAFTS:
            keep += num_tokens - 1
        j = tl.arange(0, BLOCK_S)
        e = W - 1 + num_tokens - keep + j
        tile = _extended_tile(x_ptr, stride_x, bos, num_tokens, state_row_ptr, stride_r, first_row, has_state,
                              e, cols, col_mask, W)
        state_ptrs = state_row_ptr + j.to(tl.int64)[:, None] * stride_r + cols[None, :]
        # The new rows overwrite rows this program's other threads read (history shifts up): every
        # thread's loads, the output's included, must be done before any thread stores.
        tl.debug_barrier()
        tl.store(state_ptrs, tile.to(state_ptr.dtype.element_ty), mask=(j < keep)[:, None] & col_mask[None, :])
