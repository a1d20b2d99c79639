"""DTensor inputs: ops act on the local shard; a 1-D mesh is the default group."""

from __future__ import annotations

import pytest
import torch

import funcoll
from funcoll.testing import run_ranks


def _dtensor_cases(rank: int, world: int) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(7 * 3, dtype=torch.float64).view(7, 3)  # 7 rows: uneven shards
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    out: dict[str, object] = {"gather": funcoll.gather(sharded)}
    out["all_reduce_replicated"] = funcoll.all_reduce(distribute_tensor(full, mesh, [Replicate()]))
    dt = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
    funcoll.gather(dt).pow(2).sum().backward()
    out["local"] = dt.to_local().detach()
    out["local_grad"] = dt.grad.to_local()
    mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    on2d = distribute_tensor(full, mesh2, [Replicate(), Shard(0)])
    try:
        funcoll.gather(on2d)
    except ValueError as e:
        out["2d_error"] = str(e)
    out["2d_tp"] = funcoll.gather(on2d, group=(mesh2, "tp"))
    # gather_padded: equal local shards of 2 rows, of which rank r keeps r % 3 (0, 1 or 2).
    even = distribute_tensor(_two_rows_each(world), mesh, [Shard(0)])
    out["gather_padded"] = funcoll.gather_padded(even, rank % 3)
    return out


def _two_rows_each(world: int) -> torch.Tensor:
    return torch.arange(2 * world * 3, dtype=torch.float64).view(2 * world, 3)


@pytest.mark.parametrize("world", [2, 3])
def test_dtensor_local_shards(world: int) -> None:
    full = torch.arange(7 * 3, dtype=torch.float64).view(7, 3)
    for _rank, out in enumerate(run_ranks(_dtensor_cases, world, timeout=120)):
        assert type(out["gather"]) is torch.Tensor
        torch.testing.assert_close(out["gather"], full)
        torch.testing.assert_close(out["all_reduce_replicated"], world * full)
        torch.testing.assert_close(out["2d_tp"], full)
        # Every rank's loss sum(full**2) reaches every row: each shard's gradient is
        # 2 * world * its rows (the ragged reduce_scatter sums the ranks' gradients).
        torch.testing.assert_close(out["local_grad"], 2 * world * out["local"])
        assert "funcoll.gather" in out["2d_error"] and "2-D mesh" in out["2d_error"]
        rows = _two_rows_each(world)
        lengths = [r % 3 for r in range(world)]
        data = torch.cat([rows[2 * r : 2 * r + n] for r, n in enumerate(lengths)])
        y, sizes = out["gather_padded"]
        assert type(y) is torch.Tensor
        torch.testing.assert_close(y, torch.cat([data, data.new_zeros(2 * world - data.shape[0], 3)]))
        assert sizes.tolist() == lengths
