"""funcoll: JAX-style functional collectives for PyTorch.

Pure functions (new tensors out), differentiable with the adjoint as the backward,
ragged along any dim, and traceable by ``torch.compile(fullgraph=True)``. Built on
the ``torch.ops._c10d_functional`` ops.
"""

from . import lax as lax  # the submodule: funcoll.lax.psum after `import funcoll`
from . import moe as moe  # the submodule: funcoll.moe.dispatch after `import funcoll`
from ._base._compile import allow_compile_caches, mark_ragged
from ._base._config import checks_enabled, set_checks
from ._base._group import Group, GroupLike, axis_index, axis_size
from ._base._quant import Wire
from ._base._version import __version__ as __version__
from ._collective._async import wait
from ._ops._even import (
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all,
    broadcast,
    ppermute,
    reduce,
    reduce_scatter,
    split_sizes,
)
from ._ops._ragged import all_gather_list, all_gather_ragged, all_to_all_v, gather, scatter
from ._ops._region import gather_forward_split_backward, split_forward_gather_backward
from ._ops._shard import from_ragged, to_ragged
from ._ops._static import all_to_all_padded, gather_padded
from ._shard_map import P, shard_map
from ._vma import typeof

__all__ = [
    "Group",
    "GroupLike",
    "P",
    "Wire",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_list",
    "all_gather_ragged",
    "all_reduce",
    "all_to_all",
    "all_to_all_padded",
    "all_to_all_v",
    "allow_compile_caches",
    "axis_index",
    "axis_size",
    "broadcast",
    "checks_enabled",
    "from_ragged",
    "gather",
    "gather_forward_split_backward",
    "gather_padded",
    "mark_ragged",
    "ppermute",
    "reduce",
    "reduce_scatter",
    "scatter",
    "set_checks",
    "shard_map",
    "split_forward_gather_backward",
    "split_sizes",
    "to_ragged",
    "typeof",
    "wait",
]
