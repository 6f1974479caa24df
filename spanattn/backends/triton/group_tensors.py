"""The span-group tensors the triton backend's kernels take, cached on the plan: the portable
kernels' (kernel.py, kernel_dq.py) and the Gluon kernels' (group_walk.py). Kept apart from the
package's routing (__init__.py) so that the backward (gradients.py), which the package imports,
reads them without importing the package."""

from __future__ import annotations

from ...groups import tile_runs


def group_args(plan, block_n: int) -> tuple:
    """The kernels' span group tensors (groups.py): query groups, key groups, and where each
    group's tile runs are (``tile_runs`` for ``block_n``-key tiles, cached on the plan). A plan
    without groups passes its ``lo`` four times: the kernel compiled with ``GROUPS=False`` never
    reads them."""
    g = plan.groups
    if g is None:
        return (plan.lo,) * 4
    runs, index = plan.cached(
        ("triton.group_runs", block_n), lambda: tile_runs(g, plan.cu_seqlens_k, block_n)
    )
    return g.q_group, g.k_group, index, runs


def gluon_group_args(plan, sched) -> tuple | None:
    """The Gluon kernels' span group tensors (group_walk.py) for ``sched`` (the plan's schedule,
    which carries its group walk): query groups, key groups, key tile groups (cached on the plan)
    and the walk; None for a plan without groups."""
    g = plan.groups
    if g is None:
        return None
    from .key_tile_groups_triton import plan_key_tile_groups

    return g.q_group, g.k_group, plan_key_tile_groups(plan, sched.block_n), sched.walk
