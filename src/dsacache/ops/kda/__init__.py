"""KDA layers on the pool's state rows: the short causal conv (this project's Triton kernel,
``conv.py``, with its PyTorch twin in ``naive.py``) and the KDA recurrence (fla-core's
kernels and references), decode and prefill, in place on the per-layer state views that
:meth:`dsacache.runtime.CachePool.kda_state_views` hands out. ``api.py`` holds the public
functions exported here; ``launch.py`` the launches.
"""

from dsacache.ops.kda.api import (
    causal_conv1d_prefill_indexed,
    causal_conv1d_update_indexed,
    kda_decode,
    kda_prefill,
)

__all__ = [
    "causal_conv1d_prefill_indexed",
    "causal_conv1d_update_indexed",
    "kda_decode",
    "kda_prefill",
]
