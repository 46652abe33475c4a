"""Muon on FSDP2's row shards: each matrix orthogonalised whole on one owner rank, its rows sent back.

Newton-Schulz needs the whole matrix (orthogonalising each shard alone is another optimizer), and FSDP2 gives each
rank a contiguous range of rows (``Shard(0)``, torch's chunking: ``ceil(rows / world)`` per rank, the last ranks
fewer or none). So, for the matrices of one step, in the same order on every rank:

1. owners: the matrices sorted by shape, then dealt round-robin (owner = position % world), so that each rank
   orthogonalises a share of every shape and batches its same-shaped ones (the ``orthogonalize`` it is given:
   :func:`.muon.orthogonalized`, which calls this module, not the reverse);
2. in rounds of at most ``chunk * world`` elements (a larger matrix alone), so no buffer grows with the model:
   each rank writes its rows of the round's momentum updates (already cast to Newton-Schulz's dtype: the same
   rounding as one process) into one buffer, ordered by owner, and one ``all_to_all_single`` gives every owner the
   whole of its matrices; it orthogonalises them and writes each rank's rows back into the buffer it received,
   which has exactly the layout of the return trip; a second ``all_to_all_single`` brings every rank its rows.

Why all-to-all: each element crosses the network once each way, and only to the rank that needs it. Per rank and
step, with N the Muon parameters, W ranks, even shards, balanced owners and Newton-Schulz in bf16 (2 bytes): on the
way there ``2 N (W - 1) / W**2`` bytes sent (its rows of the matrices others own) and as many received (the others'
rows of its own matrices), the same on the way back: ``4 N (W - 1) / W**2`` bytes sent and as many received per
step (:func:`bytes_per_step` counts them for given shapes; fp32 Newton-Schulz: twice). DTensor's ``full_tensor()``
(an all-gather) would bring every rank every whole matrix, ``2 N (W - 1) / W`` received by each (``W / 2`` times
as much), and have every rank compute every Newton-Schulz; ``gather`` / ``scatter`` per matrix would cost two
collectives per matrix instead of two per round.

The numbers are one process's: a whole matrix arrives with the bits the single process stacks (elementwise cast,
rows copied), and :func:`.muon.newton_schulz_` gives each matrix the same bits in any batch where the matmul does
(CPU: checked by the tests; on GPUs, cuBLAS may pick another kernel for another batch size).
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import torch
from torch import Tensor

from . import _sharded

__all__ = ["row_ranges", "plan", "orthogonalized_shards", "bytes_per_step"]


def row_ranges(rows: int, world: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each rank's rows of a ``Shard(0)`` tensor with ``rows`` rows (``torch.chunk``: ranks of
    ``ceil(rows / world)`` rows, the last ones fewer or none), as FSDP2 and DTensor place them."""
    per = -(-rows // world) if rows else 0
    return [(min(rows, r * per), min(rows, (r + 1) * per)) for r in range(world)]


def plan(shapes: list[tuple[int, int]], world: int, chunk: int) -> list[list[tuple[int, int]]]:
    """Rounds of ``(matrix index, owner rank)``: matrices sorted by shape (stable), owners dealt round-robin in that
    order, rounds of consecutive matrices holding at most ``chunk * world`` elements (a larger matrix alone). Every
    rank computes the same plan from the global shapes, with no communication."""
    order = sorted(range(len(shapes)), key=lambda i: tuple(shapes[i]))
    rounds, total = [[]], 0
    for pos, i in enumerate(order):
        n = math.prod(shapes[i])
        if rounds[-1] and total + n > chunk * world:
            rounds.append([])
            total = 0
        rounds[-1].append((i, pos % world))
        total += n
    return [r for r in rounds if r]


def bytes_per_step(shapes: list[tuple[int, int]], world: int, rank: int, chunk: int, element_size: int = 2) -> int:
    """Bytes ``rank`` sends in one step under :func:`plan`, both trips (it receives as many: the return trip
    mirrors the first); rows that stay on their rank are not counted. ``element_size``: Newton-Schulz's dtype's."""
    moved = 0
    for round_ in plan(shapes, world, chunk):
        for i, owner in round_:
            rows, cols = shapes[i]
            start, stop = row_ranges(rows, world)[rank]
            # an owner receives the others' rows, then sends them back; any other rank sends its rows, then receives
            moved += (rows - (stop - start) if owner == rank else stop - start) * cols
    return element_size * moved


def orthogonalized_shards(params: list, fill: Callable[[int, Tensor], object], orthogonalize: Callable, *,
                          dtype: torch.dtype, chunk: int) -> Iterator[tuple[list[int], list[Tensor]]]:
    """Orthogonalise the whole matrices of ``params`` (DTensors, ``Shard(0)`` on one 1-D mesh, the same list on
    every rank: a collective) and yield ``(indices, rows)``: ``rows[j]`` this rank's rows of matrix ``indices[j]``
    orthogonalised, in ``dtype`` (views, valid until the next round). ``fill(i, out)`` writes this rank's rows of
    matrix ``i`` (its local shape) into ``out``; ``orthogonalize(shapes, fill, device=)`` is
    :func:`.muon.orthogonalized` with its settings (``dtype``, ``chunk``: the same as here)."""
    import torch.distributed as dist

    if not params:
        return
    mesh = params[0].device_mesh
    if any(p.device_mesh != mesh for p in params):
        raise ValueError("Muon: sharded parameters on several device meshes cannot be stepped together; give each "
                         "mesh's parameters their own optimizer")
    group, world, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    device = _sharded.local(params[0]).device
    shapes = [tuple(p.shape) for p in params]
    ranges = [row_ranges(rows, world) for rows, _ in shapes]
    for i, p in enumerate(params):
        start, stop = ranges[i][rank]
        if _sharded.local(p).shape[0] != stop - start:
            raise ValueError(f"Muon: parameter {i} of shape {shapes[i]} holds {_sharded.local(p).shape[0]} rows on "
                             f"rank {rank}, not the {stop - start} of torch's Shard(0) chunking")

    def rows_of(i: int, r: int) -> int:
        return (ranges[i][r][1] - ranges[i][r][0]) * shapes[i][1]  # elements of rank r's rows of matrix i

    for round_ in plan(shapes, world, chunk):
        by_owner = [[i for i, o in round_ if o == r] for r in range(world)]
        mine = by_owner[rank]
        # send: segment r = my rows of rank r's matrices; recv: segment r = rank r's rows of my matrices. On the
        # return trip the owners send from recv's layout and every rank receives into send's.
        send_sizes = [sum(rows_of(i, rank) for i in by_owner[r]) for r in range(world)]
        recv_sizes = [sum(rows_of(i, r) for i in mine) for r in range(world)]
        send = torch.empty(sum(send_sizes), dtype=dtype, device=device)
        recv = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
        local_rows = {}  # matrix -> its view in send (my rows)
        pos = 0
        for r in range(world):
            for i in by_owner[r]:
                n = rows_of(i, rank)
                local_rows[i] = send[pos:pos + n].view(-1, shapes[i][1])
                fill(i, local_rows[i])
                pos += n
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
        pieces = {i: [] for i in mine}  # matrix -> [(start row, view in recv)] of each rank's rows
        pos = 0
        for r in range(world):
            for i in mine:
                n = rows_of(i, r)
                pieces[i].append((ranges[i][r][0], recv[pos:pos + n].view(-1, shapes[i][1])))
                pos += n

        def assemble(j: int, out: Tensor) -> None:
            for start, rows in pieces[mine[j]]:
                out[start:start + rows.shape[0]].copy_(rows)

        for idx, results in orthogonalize([shapes[i] for i in mine], assemble, device=device):
            for j, result in zip(idx, results):
                for start, rows in pieces[mine[j]]:
                    rows.copy_(result[start:start + rows.shape[0]])
        dist.all_to_all_single(send, recv, send_sizes, recv_sizes, group=group)
        order = [i for r in range(world) for i in by_owner[r]]
        yield order, [local_rows[i] for i in order]
