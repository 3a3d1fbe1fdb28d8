"""Piece builders for sharded senders (docs/REFIT.md, Sharded senders): what each trainer rank
declares, for the layouts trainers use. Each returns the `pieces` that
RefitSender(name, state_dict, rank=r, world=M, pieces=pieces) takes: {local name:
Piece(global name, dim, start, stop)}; a local tensor without an entry is sent whole under its
own name (replicated when several ranks hold it: receivers read it from one of them).

- tp_pieces(state_dict, rank, world, rules, fused=None, shapes=None) -> (state_dict, pieces):
  Megatron tensor parallelism, with the same (regex, dim) rules and `fused` map as tp_shards;
- fsdp_pieces(shapes, rank, world) -> (slices, pieces): every tensor split along dim 0 over the
  world, the last shard shorter;
- expert_pieces(state_dict, rank, world, pattern, num_experts, placement="contiguous",
  local_index=False) -> (state_dict, pieces): tensors whose names carry an expert index, held by
  the rank that owns the expert (placed contiguously or round robin).

Pure Python: nothing here talks to the library.
"""
import re
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from ..errors import InvalidArgument
from .shards import Piece, tp_shards

__all__ = ["tp_pieces", "fsdp_pieces", "expert_pieces"]


def _shape(obj: Any) -> Tuple[int, ...]:
    """The shape of a tensor, an array, or a shape given as a sequence of ints."""
    if hasattr(obj, "shape"):
        return tuple(int(x) for x in obj.shape)
    return tuple(int(x) for x in obj)


def _check_rank(what: str, rank: int, world: int) -> Tuple[int, int]:
    rank, world = int(rank), int(world)
    if world < 1 or not 0 <= rank < world:
        raise InvalidArgument(-1, "%s: rank %d of world %d" % (what, rank, world))
    return rank, world


def _rows(obj: Any, start: int, stop: int) -> Any:
    """Rows [start, stop) of obj along dim 0: a view (torch tensor or numpy array)."""
    if hasattr(obj, "narrow"):
        return obj.narrow(0, start, stop - start)
    return obj[start:stop]


def tp_pieces(state_dict: Mapping[str, Any], rank: int, world: int,
                rules: Sequence[Tuple[str, Optional[int]]],
                fused: Optional[Dict[str, Sequence[str]]] = None,
                shapes: Optional[Mapping[str, Any]] = None
                ) -> Tuple[Dict[str, Any], Dict[str, Piece]]:
    """Megatron tensor parallelism: `state_dict` is rank `rank`'s own tensors (of `world`), named
    as the global model names them, each holding this rank's slice; rules and fused mean what
    they mean to tp_shards (the receivers' side): the first (regex, dim) rule that matches a
    global name (re.search) says the tensor is split along dim into `world` equal parts, rank r
    holding part r (dim None, or no rule matches: every rank holds it whole); fused
    {local name: [global names]} is a local tensor made of those tensors' slices laid one after
    another along its dim 0 (a column-parallel qkv: this rank's rows of q, then of k, then of v).

    Returns (state_dict, pieces):
    - state_dict: the tensors to declare: the input's, except that each fused tensor is replaced
      by one view per global tensor it is made of, named by that global name (rows of the fused
      tensor: views, never copies, so the trainer's in-place updates are what is sent);
    - pieces: {local name: Piece(global name, dim, rank * n, (rank + 1) * n)} for every split
      tensor (n: the global size along dim over world); replicated tensors have no entry.

    shapes: {global name: global shape} for the global tensors of a fused local tensor; without
    it that tensor's rows are shared equally among them (right for gate/up; q, k and v differ in
    size under grouped-query attention). Every other global shape is the local one with its
    split dim `world` times as long. Raises InvalidArgument for a rank outside the world, a
    tensor without the dim its rule splits, a fused tensor whose rows are not its parts', or a
    name that is both fused and declared on its own."""
    rank, world = _check_rank("tp_pieces", rank, world)
    fused = {k: list(v) for k, v in (fused or {}).items()}
    shapes = {k: _shape(v) for k, v in (shapes or {}).items()}
    compiled = [(re.compile(rx), d) for rx, d in rules]

    def dim_of(name):
        return next((d for rx, d in compiled if rx.search(name)), None)

    def global_shape(name, local):
        if name in shapes:
            return shapes[name]
        d = dim_of(name)
        if d is None:
            return local
        if not 0 <= d < len(local):
            raise InvalidArgument(-1, "tp_pieces: '%s' %s has no dim %d" % (name, list(local), d))
        return local[:d] + (local[d] * world,) + local[d + 1:]

    glob = {}  # global name -> global shape
    for name, obj in state_dict.items():
        local = _shape(obj)
        if name in fused:
            sources = fused[name]
            if not local:
                raise InvalidArgument(-1, "tp_pieces: fused '%s' is a scalar" % name)
            missing = [s for s in sources if s not in shapes]
            if missing and (len(missing) != len(sources) or local[0] % len(sources)):
                raise InvalidArgument(-1, "tp_pieces: fused '%s' (%d rows): give shapes= for %s"
                                      % (name, local[0], missing))
            for s in sources:
                if s in state_dict:
                    raise InvalidArgument(-1, "tp_pieces: '%s' is in fused '%s' and in the "
                                          "state dict on its own" % (s, name))
                part = (local[0] // len(sources),) + local[1:]
                glob[s] = global_shape(s, part)
        else:
            glob[name] = global_shape(name, local)
    specs = tp_shards(glob, rank, world, rules, fused=fused)

    out, pieces = {}, {}
    for name, obj in state_dict.items():
        local = _shape(obj)
        shape, _, parts = specs[name]
        if tuple(shape) != local:
            raise InvalidArgument(-1, "tp_pieces: '%s' is %s on rank %d, but its global "
                                  "shape%s split %d ways gives %s"
                                  % (name, list(local), rank, "s" if name in fused else "",
                                     world, list(shape)))
        if name not in fused:
            out[name] = obj
            if dim_of(name) is not None:
                pieces[name] = parts[0]
            continue
        at = 0
        for p in parts:
            rows = p.stop - p.start if p.dim == 0 else glob[p.source][0]
            out[p.source] = _rows(obj, at, at + rows)
            at += rows
            if dim_of(p.source) is not None:
                pieces[p.source] = p
    return out, pieces


def fsdp_pieces(shapes: Mapping[str, Any], rank: int, world: int
         ) -> Tuple[Dict[str, Any], Dict[str, Piece]]:
    """FSDP: every tensor split along dim 0 over the world as torch.chunk splits it: shards of
    ceil(rows / world) rows, rank r holding rows [r * c, min((r + 1) * c, rows)), so the last
    shard that holds anything is shorter (and with fewer rows than ranks, the last ranks hold
    none of that tensor). shapes: {global name: global shape} (or the full tensors).

    Returns (slices, pieces): slices {name: index} for every tensor this rank holds any of:
    full[slices[name]] is this rank's local tensor (slice(start, stop) of dim 0; `...`, the
    whole tensor, for a 0-d tensor, which every rank holds whole: receivers read it from one of
    them); pieces {name: Piece(name, 0, start, stop)} for the split ones (local names are the
    global names). A tensor of 0 rows is held whole by rank 0."""
    rank, world = _check_rank("fsdp_pieces", rank, world)
    slices, pieces = {}, {}
    for name, s in shapes.items():
        shape = _shape(s)
        if not shape:
            slices[name] = ...
            continue
        rows = shape[0]
        if rows == 0:
            if rank == 0:
                slices[name] = slice(0, 0)
            continue
        c = -(-rows // world)
        start, stop = min(rank * c, rows), min((rank + 1) * c, rows)
        if start == stop:
            continue
        slices[name] = slice(start, stop)
        pieces[name] = Piece(name, 0, start, stop)
    return slices, pieces


def _owner(e: int, num_experts: int, world: int, placement: str) -> int:
    if placement == "contiguous":
        return e // -(-num_experts // world)
    return e % world


def _global_index(i: int, rank: int, num_experts: int, world: int, placement: str) -> int:
    if placement == "contiguous":
        return rank * -(-num_experts // world) + i
    return i * world + rank


def expert_pieces(state_dict: Mapping[str, Any], rank: int, world: int, pattern: str,
                    num_experts: int, placement: str = "contiguous", local_index: bool = False
                    ) -> Tuple[Dict[str, Any], Dict[str, Piece]]:
    """Expert parallelism: a tensor whose name matches `pattern` (a regex whose first group is the
    expert index, e.g. r"\\.experts\\.(\\d+)\\.") belongs to that expert and is held by the rank
    that owns it; every other tensor is held whole by every rank (replicated: receivers read it
    from one of them). num_experts experts over `world` ranks, by placement:
    - "contiguous": blocks of c = ceil(num_experts / world) experts, rank r owning
      [r * c, min((r + 1) * c, num_experts)) (Megatron's layout);
    - "round_robin": expert e owned by rank e % world.

    local_index False: the names carry global expert indices (state_dict may be the whole
    model's): returns (the tensors rank `rank` holds: its experts' and the replicated ones, {}).
    Nothing is renamed, so no pieces are needed. local_index True: state_dict is this rank's own
    and the names carry its local index i (Megatron's local_experts.i): each is declared under
    the global name (the index replaced by the global one: r * c + i contiguous, i * world + r
    round robin) as a piece covering the whole tensor: returns (state_dict unchanged, {local
    name: Piece(global name, 0, 0, rows)}); a 0-d expert tensor cannot be renamed that way
    (InvalidArgument). Raises InvalidArgument for an index outside [0, num_experts) or one this
    rank does not own."""
    rank, world = _check_rank("expert_pieces", rank, world)
    if placement not in ("contiguous", "round_robin"):
        raise InvalidArgument(-1, "expert_pieces: placement=%r; pass 'contiguous' or "
                              "'round_robin'" % (placement,))
    num_experts = int(num_experts)
    if num_experts < 1:
        raise InvalidArgument(-1, "expert_pieces: num_experts=%d" % num_experts)
    rx = re.compile(pattern)
    if rx.groups < 1:
        raise InvalidArgument(-1, "expert_pieces: pattern %r has no group for the expert index"
                              % pattern)
    out, pieces = {}, {}
    for name, obj in state_dict.items():
        m = rx.search(name)
        if m is None:
            out[name] = obj
            continue
        i = int(m.group(1))
        e = _global_index(i, rank, num_experts, world, placement) if local_index else i
        if not 0 <= e < num_experts or (local_index and _owner(e, num_experts, world, placement)
                                        != rank):
            raise InvalidArgument(-1, "expert_pieces: '%s': expert %d is not rank %d's (%d "
                                  "experts over %d ranks, %s)" % (name, e, rank, num_experts,
                                                                  world, placement))
        if not local_index:
            if _owner(e, num_experts, world, placement) == rank:
                out[name] = obj
            continue
        shape = _shape(obj)
        if not shape:
            raise InvalidArgument(-1, "expert_pieces: '%s' is 0-d: it cannot be declared "
                                  "under another name" % name)
        out[name] = obj
        gname = name[:m.start(1)] + str(e) + name[m.end(1):]
        if gname != name:
            pieces[name] = Piece(gname, 0, 0, shape[0])
    return out, pieces
