"""Launchers: this project's conv kernel, and fla-core's KDA kernels on the pool's state views.

No argument checks here (``api.py`` does them); nothing here syncs with the host except
``chunk_kda`` itself and the prefill's state scatter (a prefill is not graph-captured).
"""

from __future__ import annotations

import torch
import triton

from dsacache.ops.kda.conv import conv_indexed_kernel

#: Channels a program covers: 256 bf16 = 512 B a row, enough in flight for a memory-bound op.
BLOCK_C = 256
#: Prefill tokens a program covers: the W taps reread 64 + W - 1 rows, 5 % extra at W = 4.
PREFILL_BLOCK_T = 64


def _launch_conv(x, out, conv_states, state_indices, weight, bias, *, next_n, num_accepted_tokens,
                 has_initial_state, query_start_loc, keep_drafts, silu, write_out, write_state, token_blocks,
                 block_t):
    batch, channels, width = state_indices.shape[0], x.shape[1], weight.shape[1]
    if batch == 0:
        return
    keep = width - 1 + (next_n - 1 if keep_drafts else 0)
    dummy = state_indices
    grid = (batch, token_blocks, triton.cdiv(channels, BLOCK_C))
    conv_indexed_kernel[grid](
        x, x.stride(0), out, out.stride(0),
        conv_states, conv_states.stride(0), conv_states.stride(1),
        state_indices,
        num_accepted_tokens if num_accepted_tokens is not None else dummy,
        has_initial_state if has_initial_state is not None else dummy,
        query_start_loc if query_start_loc is not None else dummy,
        weight, weight.stride(0), weight.stride(1),
        bias if bias is not None else weight,
        channels, conv_states.shape[0],
        NEXT_N=next_n, W=width, KEEP_DRAFTS=keep_drafts,
        HAS_ACCEPTED=num_accepted_tokens is not None, HAS_INITIAL=has_initial_state is not None,
        HAS_BIAS=bias is not None, SILU=silu, WRITE_OUT=write_out, WRITE_STATE=write_state,
        BLOCK_T=block_t, BLOCK_S=triton.next_power_of_2(max(keep, 1)), BLOCK_C=BLOCK_C,
        num_warps=4,
    )


def launch_conv_decode(x, out, conv_states, state_indices, weight, bias, next_n, num_accepted_tokens, silu):
    """One program a (request, channel block): outputs, then the state update, in one launch."""
    _launch_conv(x, out, conv_states, state_indices, weight, bias, next_n=next_n,
                 num_accepted_tokens=num_accepted_tokens, has_initial_state=None, query_start_loc=None,
                 keep_drafts=True, silu=silu, write_out=True, write_state=True, token_blocks=1,
                 block_t=triton.next_power_of_2(next_n))


def launch_conv_prefill(x, out, conv_states, state_indices, weight, bias, query_start_loc, has_initial_state,
                        max_query_len, silu):
    """Outputs over token blocks, then the state update (a second launch: the blocks all read the history)."""
    common = dict(next_n=0, num_accepted_tokens=None, has_initial_state=has_initial_state,
                  query_start_loc=query_start_loc, keep_drafts=False, silu=silu)
    blocks = triton.cdiv(max_query_len, PREFILL_BLOCK_T)
    if blocks:
        _launch_conv(x, out, conv_states, state_indices, weight, bias, **common, write_out=True,
                     write_state=False, token_blocks=blocks, block_t=PREFILL_BLOCK_T)
    _launch_conv(x, out, conv_states, state_indices, weight, bias, **common, write_out=False, write_state=True,
                 token_blocks=1, block_t=1)


def launch_recurrent_decode(q, k, v, g, beta, out, recurrent_states, state_indices, num_accepted_tokens, scale,
                            qk_l2norm):
    """fla-core's fused recurrent KDA, in place on the strided state view (``-1`` -> the guard row)."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    fused_recurrent_kda_fwd(
        q=q, k=k, v=v, g=g, beta=beta, initial_state=recurrent_states, scale=scale,
        inplace_final_state=True, ssm_state_indices=state_indices, num_accepted_tokens=num_accepted_tokens,
        use_qk_l2norm_in_kernel=qk_l2norm, out=out,
    )


def launch_chunk_prefill(q, k, v, g, beta, out, recurrent_states, state_indices, cu_seqlens, has_initial_state,
                         scale, qk_l2norm):
    """fla-core's ``chunk_kda`` on ragged inputs: initial states gathered, final states scattered back."""
    from fla.ops.kda import chunk_kda

    safe = state_indices.clamp(min=0).long()
    use = (state_indices >= 0) & has_initial_state
    initial = torch.where(use[:, None, None, None], recurrent_states[safe], 0.0).float()
    with torch.no_grad():
        o, final = chunk_kda(
            q[None], k[None], v[None], g[None], beta[None], scale=scale, initial_state=initial,
            output_final_state=True, use_qk_l2norm_in_kernel=qk_l2norm, cu_seqlens=cu_seqlens.long(),
        )
    out.copy_(o[0])
    live = state_indices >= 0
    recurrent_states[state_indices[live].long()] = final[live]
