"""Shards: tensor-parallel ranks that keep a slice of each tensor (docs/REFIT.md, Shards): Piece,
and tp_shards(), which computes a rank's pieces (RefitReceiver.bind_shards binds them)."""
import re
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from ..errors import InvalidArgument


class Piece(NamedTuple):
    """Piece(source, dim, start, stop): the elements of the sender's tensor `source` whose index
    along `dim` lies in [start, stop). A target (an engine tensor) is one or more pieces laid one
    after another along its dim 0 (a fused qkv_proj shard: a q, a k and a v piece).

    A sharded sender's rank declares its tensors with the same description,
    Piece(global_name, dim, start, stop): that local tensor is the slice of the global tensor
    `global_name` (RefitSender(..., pieces={local name: Piece(...)}))."""
    source: str
    dim: int
    start: int
    stop: int

    @property
    def global_name(self) -> str:
        """`source`, by the name a sender's piece gives it: the global tensor's."""
        return self.source


def _shapes_of(manifest_or_shapes: Any) -> Dict[str, Tuple[Tuple[int, ...], Optional[str]]]:
    """{name: (shape, dtype)} from a RefitReceiver, its manifest() list, or {name: shape} /
    {name: (shape, dtype)}."""
    from .receiver import RefitReceiver  # which imports this module
    src = manifest_or_shapes
    if isinstance(src, RefitReceiver):
        src = src.manifest()
    if isinstance(src, dict):
        out = {}
        for name, v in src.items():
            if (isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], str)):
                out[name] = (tuple(int(x) for x in v[0]), v[1])
            else:
                out[name] = (tuple(int(x) for x in v), None)
        return out
    return {m["name"]: (tuple(m["shape"]), m.get("dtype")) for m in src}


def _split(name: str, shape: Tuple[int, ...], dim: Optional[int], rank: int, world: int) -> Piece:
    if dim is None:
        return Piece(name, 0, 0, shape[0] if shape else 1)
    if dim < 0 or dim >= len(shape):
        raise InvalidArgument(-1, "tp_shards: '%s' %s has no dim %d" % (name, list(shape), dim))
    if shape[dim] % world:
        raise InvalidArgument(-1, "tp_shards: '%s' dim %d (size %d) does not split in %d"
                              % (name, dim, shape[dim], world))
    n = shape[dim] // world
    return Piece(name, dim, rank * n, (rank + 1) * n)


def tp_shards(manifest_or_shapes: Any, rank: int, world: int,
              rules: Sequence[Tuple[str, Optional[int]]],
              fused: Optional[Dict[str, Sequence[str]]] = None
              ) -> Dict[str, Tuple[Tuple[int, ...], Optional[str], List[Piece]]]:
    """The shards of tensor-parallel rank `rank` of `world`: {target: (shape, dtype, [Piece])},
    so that an engine rank allocates each target and binds it:

        specs = ferry.tp_shards(rx, rank, world,
                                rules=[(r"\\.(q|k|v|gate|up)_proj\\.", 0),   # column-parallel
                                       (r"\\.(o|down)_proj\\.", 1),          # row-parallel
                                       (r"norm", None)],                    # replicated
                                fused={"qkv_proj.weight": ["q_proj.weight", "k_proj.weight",
                                                           "v_proj.weight"]})
        mine = {t: torch.empty(shape, dtype=getattr(torch, dtype))
                for t, (shape, dtype, _) in specs.items()}
        rx.bind_shards({t: (mine[t], specs[t][2]) for t in specs})

    manifest_or_shapes: a RefitReceiver, its manifest(), or {name: shape} / {name: (shape,
    dtype)}; dtype is then the wire dtype's name ("bfloat16", "float32", ...; None when only
    shapes were given). rules: (regex, dim) pairs tried in order against each sender tensor's name
    (re.search); the first match splits that tensor along dim into `world` equal parts (dim
    None: every rank keeps it whole); a tensor no rule matches is replicated. fused: {target:
    [sources]}: the sources' slices laid one after another along the target's dim 0 (the
    sources then have no target of their own). Raises InvalidArgument for a dim a tensor lacks,
    a size that does not split in `world`, or a fused source that is not sent."""
    rank, world = int(rank), int(world)
    if world < 1 or not 0 <= rank < world:
        raise InvalidArgument(-1, "tp_shards: rank %d of world %d" % (rank, world))
    shapes = _shapes_of(manifest_or_shapes)
    compiled = [(re.compile(rx), d) for rx, d in rules]

    def piece_of(name):
        shape = shapes[name][0]
        dim = next((d for rx, d in compiled if rx.search(name)), None)
        return _split(name, shape, dim, rank, world)

    def piece_shape(p):
        shape = list(shapes[p.source][0]) or [1]
        shape[p.dim] = p.stop - p.start
        return shape

    out = {}
    taken = set()
    for target, sources in (fused or {}).items():
        missing = [s for s in sources if s not in shapes]
        if missing:
            raise InvalidArgument(-1, "tp_shards: fused '%s': the sender sends no %s"
                                  % (target, missing))
        pieces = [piece_of(s) for s in sources]
        shape = piece_shape(pieces[0])
        shape[0] = sum(piece_shape(p)[0] for p in pieces)
        out[target] = (tuple(shape), shapes[sources[0]][1], pieces)
        taken.update(sources)
    for name, (shape, dtype) in shapes.items():
        if name in taken:
            continue
        p = piece_of(name)
        out[name] = (tuple(piece_shape(p)) if shape else (), dtype, [p])
    return out
