"""Muon's bytes for the planner (`train.optimizer=muon`): momentum state, the owner exchange, the owner's transient.

Muon (framework/train/muon.py) keeps one momentum buffer per hidden-matrix element, placed like its parameter, in
the parameter's storage dtype (fp32: the master copy under mixed precision), instead of AdamW's two moments; the
embeddings, head, norms, biases and router stay on AdamW. `framework/parallel/whole_matrix.py` assembles every
matrix on one owner rank per step, and the planner counts that exchange as the code runs it, one bucket per set of
groups (the optimizer of each model part owns its buckets):

  primary group   FSDP's shard group (dp x cp) when ZeRO shards and it has more than one rank, else tp for a
                  tp-split matrix (none: the rank holds whole matrices and nothing moves). Experts (stacked,
                  whole along ep) go over FSDP's expert group (dp x tp / ep).
  secondary hop   tp under FSDP x TP for tp-split matrices: one all-gather of the dp shards (its output, tp
                  pieces of 1/N of the matrix, is what the communication logger counts). Overlapped, none:
                  the pieces go over the dp_shard x tp ranks ("dp_shard_tp") to one owner among them.
  owners          round-robin by matrix in the part's parameter order; each owner gets the unit whole (a matrix,
                  or a rank's block of E/ep experts), runs Newton-Schulz, and sends every piece back.

Per step, a rank's all_to_all payload (the logger counts each call's input) is 4 (S2 + O) bytes: S2, its buffer
after the secondary hop (1/N of each matrix), sent out; O, the elements of the matrices it owns, sent back. The
planner reports the busiest owner (the largest O of the group), which with the round-robin is the group's first
rank whenever the matrices come in repeating per-layer shapes.

Transient on that owner, after backward (activations are gone by then): the larger of
  the exchange:      S + S2 + 2 O      (momentum pieces S, the received or returned buffer, results, send buffer)
  Newton-Schulz:     S + O             (pieces; units and results, one shape group s stacked in their place)
                     plus the NS working memory of group s in `train.muon.ns_dtype` (`_ns_work`: about n (4ab + a^2)
                     for n stacked a x b matrices, a <= b),
all in fp32 except the NS working set. Owners whose pieces do not arrive in order (a tp hop, row-wise tp blocks,
stacked experts cut on dim 1) keep an int32 index per element they own, between steps.
Overlapped with backward (`overlapped`: train.muon.overlap on an FSDP layout (tp included), or tp without FSDP
and pp, and under pp with a schedule whose backward is not split (not zero-bubble), as
framework/train/muon_overlap.py allows; ep, qgZ and grouped FSDP units overlap too, so nothing the planner cannot
see decides it), the raw gradient pieces reach the owners during backward and an exchanged matrix's momentum
(dense ones over dp x cp, or dp x cp x tp under FSDP x TP, or tp without FSDP; experts over edp) lives whole on
its owner: the momentum is O rather than the shards' S, and the step's transient is the larger of the return
trip (S2 + O: send and receive buffers beside the results) and Newton-Schulz, since the O received is already
live when the step starts (it grows while backward frees activations) and no Nesterov pieces are made on the
shards (those of unexchanged matrices are).
`tests/dryrun/test_ground_truth.py` holds these terms to the dry run (itself held to real gloo steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from framework.parallel.pipeline_schedules import schedule_spec, stages_of_rank
from framework.plan.layout import Layout, Workload
from models.config import ModelConfig

NS_STEPS = 5
"""train.muon.ns_steps' default (Jordan et al. 2024): each step on an a x b matrix (a <= b) costs 2a^2 b for the
Gram matrix, 2a^3 for its square and 2a^2 b for the product with the iterate."""

Unit = tuple[int, int, int]
"""(n, a, b): n stacked a x b matrices an owner assembles whole (n = E / ep for a rank's stacked experts)."""


@dataclass(frozen=True)
class MuonBytes:
    """One pipeline rank's Muon terms (bytes)."""

    elements: int = 0
    """Hidden-matrix elements on the rank after TP/EP sharding, before ZeRO (each carries a momentum element)."""
    state_delta: float = 0.0
    """Optimizer-state bytes against AdamW on the same rank: the momentum replaces two moments (negative)."""
    all_to_all: dict[str, float] = field(default_factory=dict)
    """Owner exchange payload per step by primary axis ("dp_shard", "tp", "edp"), on the busiest owner."""
    all_gather_tp: float = 0.0
    """The secondary hop's all-gather over tp (FSDP x TP), output bytes per step."""
    transient: float = 0.0
    """Peak bytes the step's Muon update holds beyond the states, on the busiest owner."""
    index: float = 0.0
    """The busiest owner's placement indices (int32 per element it places), kept between steps."""
    ns_flops: float = 0.0
    """The busiest owner's Newton-Schulz FLOPs per step (`NS_STEPS` quintic steps on every matrix it owns)."""
    overlapped: bool = False
    """The to-owner all-to-all leaves from backward (`overlapped`); the return trip stays after it."""


Dense = tuple[Unit, bool, bool]
"""A dense matrix: (unit, split by tp, split on its input dim: row-wise, whose pieces an owner must place)."""


def _attention_units(cfg: ModelConfig) -> list[Dense]:
    """One layer's attention matrices in parameter order."""
    d, h = cfg.hidden, cfg.n_heads
    if cfg.attention != "mla":
        q, kv = h * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        return [((1, q, d), True, False), ((1, kv, d), True, False), ((1, kv, d), True, False),
                ((1, d, q), True, True)]
    m = cfg.mla
    units: list[Dense] = [((1, m.q_lora_rank, d), False, False), ((1, h * m.qk_head_dim, m.q_lora_rank), True, False)
                          ] if m.q_lora_rank else [((1, h * m.qk_head_dim, d), True, False)]
    return [*units, ((1, m.kv_lora_rank + m.qk_rope_head_dim, d), False, False),
            ((1, h * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank), True, False),
            ((1, d, h * m.v_head_dim), True, True)]


def _mlp_units(cfg: ModelConfig, ffn: int) -> list[Dense]:
    d = cfg.hidden
    units: list[Dense] = [((1, ffn, d), True, False), ((1, d, ffn), True, True)]
    return [*units, ((1, ffn, d), True, False)] if cfg.mlp == "swiglu" else units


def layer_units(cfg: ModelConfig, layer: int, ep: int) -> tuple[list[Dense], list[Unit]]:
    """(dense matrices, expert units) of one layer in parameter order."""
    dense = _attention_units(cfg)
    if not cfg.is_moe_layer(layer):
        return dense + _mlp_units(cfg, cfg.ffn), []
    moe = cfg.moe
    f, d, e = moe.expert_hidden or cfg.ffn, cfg.hidden, moe.n_experts // ep
    experts = [(e, f, d), (e, d, f), (e, f, d)]
    if moe.n_shared_experts:
        dense += _mlp_units(cfg, moe.n_shared_experts * f)
    if moe.shared_expert_gate:
        dense.append(((1, 1, d), False, False))
    return dense, experts


def _numel(u: Unit) -> int:
    return u[0] * u[1] * u[2]


def _ns_work(group: list[Unit], ns_bytes: int) -> float:
    """Newton-Schulz's live bytes on n stacked a x b matrices (a <= b) beyond the stacked input (which replaces
    its units): the iterate X and its Gram matrix A, then either a X, b A, A A and c A A (2ab + 4a^2) or a X,
    (b A + c A A) X and their sum (4ab + a^2)."""
    n, a, b = sum(u[0] for u in group), min(group[0][1:]), max(group[0][1:])
    return ns_bytes * n * max(4 * a * b + a * a, 2 * a * b + 4 * a * a)


def ns_peak(units: list[Unit], ns_bytes: int) -> float:
    """What an owner's batched Newton-Schulz (whole_matrix `_batched`) adds to its units: one call per matrix shape,
    each shape's units stacked in their place and freed, so the largest group's working set."""
    by_shape: dict[tuple[int, int], list[Unit]] = {}
    for u in units:
        by_shape.setdefault(u[1:], []).append(u)
    return max((_ns_work(g, ns_bytes) for g in by_shape.values()), default=0.0)


def _buckets(cfg: ModelConfig, lay: Layout, layers: list[int], flat: bool = False
             ) -> dict[tuple[str, int], list[tuple[Unit, bool]]]:
    """One part's matrices grouped as `WholeMatrices` buckets them: (primary axis, tp split of the secondary hop)
    -> [(unit, whether its owner keeps an index)], in parameter order; axis "" where nothing moves. `flat`: the
    overlapped exchange sends FSDP x TP pieces over the dp_shard x tp ranks in one hop ("dp_shard_tp")."""
    shard = lay.shard_group if lay.zero_stage > 0 else 1
    edp = lay.dp * lay.tp // lay.ep if lay.zero_stage > 0 else 1
    out: dict[tuple[str, int], list[tuple[Unit, bool]]] = {}
    for i in layers:
        dense, experts = layer_units(cfg, i, lay.ep)
        for unit, split, rowwise in dense:
            tp = lay.tp if split else 1
            if shard > 1 and flat and tp > 1:  # one owner among the dp_shard x tp ranks, pieces placed
                out.setdefault(("dp_shard_tp", 1), []).append((unit, True))
            elif shard > 1:  # FSDP's Shard(0) alone arrives in order; with a tp hop the owner places the pieces
                out.setdefault(("dp_shard", tp), []).append((unit, tp > 1))
            else:  # tp alone: column blocks arrive in order, row-wise blocks need placing
                out.setdefault(("tp" if tp > 1 else "", 1), []).append((unit, tp > 1 and rowwise))
        for unit in experts:  # FSDP cuts a stacked expert tensor on dim 1
            out.setdefault(("edp" if edp > 1 else "", 1), []).append((unit, edp > 1))
    return out


def _part(work: Workload, lay: Layout, layers: list[int], state: int, out: dict[str, float]) -> float:
    """The transient bytes of one model part's Muon step (one optimizer); adds its traffic and the owner's index
    bytes (4 per placed element, kept between steps) into `out`."""
    cfg, ns_bytes = work.model, work.muon_ns_bytes
    sizes = {"dp_shard": lay.shard_group, "tp": lay.tp, "edp": lay.dp * lay.tp // lay.ep, "": 1,
             "dp_shard_tp": lay.shard_group * lay.tp}
    buckets = _buckets(cfg, lay, layers, flat=overlapped(work, lay))
    # apply(): every bucket's pieces (S) live throughout, the owned units (O) from the exchange on (then their
    # results); on top, one bucket's send and receive buffers at a time, or one shape group's Newton-Schulz.
    pieces = owned = exchange = 0.0
    mine: list[Unit] = []
    for (axis, split), units in buckets.items():
        size = sizes[axis]
        held = max((units[r::size] for r in range(size)), key=lambda us: sum(_numel(u) for u, _ in us))
        o, s2 = sum(_numel(u) for u, _ in held), sum(_numel(u) for u, _ in units) / size
        pieces, owned, mine = pieces + s2 / split, owned + o, mine + [u for u, _ in held]
        if axis in ("dp_shard", "edp", "tp", "dp_shard_tp"):  # exchanged: under overlap their momentum is these,
            out["owned"] = out.get("owned", 0.0) + o  # whole
            out["owned_shards"] = out.get("owned_shards", 0.0) + s2 / split  # in place of the rank's pieces
        out["index"] = out.get("index", 0.0) + 4 * sum(_numel(u) for u, placed in held if placed)
        if axis:
            out[axis] = out.get(axis, 0.0) + state * (s2 + o)
            exchange = max(exchange, s2 + o)
            if split > 1:
                out["all_gather_tp"] = out.get("all_gather_tp", 0.0) + state * s2
    ns = ns_peak(mine, ns_bytes)
    out["ns_flops"] = out.get("ns_flops", 0.0) + sum(
        NS_STEPS * n * (4 * min(a, b) ** 2 * max(a, b) + 2 * min(a, b) ** 3) for n, a, b in mine)
    if overlapped(work, lay):  # the gradient units arrived in backward; Nesterov inputs only of unexchanged units
        local = sum(_numel(u) for u, _ in buckets.get(("", 1), []))
        return state * local + max(state * exchange, ns)
    return state * (pieces + owned) + max(state * exchange, ns)


def overlapped(work: Workload, lay: Layout) -> bool:
    """Whether the owner exchange overlaps backward (framework/train/muon_overlap.py `overlap_problem`)."""
    fsdp = lay.zero_stage > 0 and lay.shard_group > 1  # FSDP x TP over the dp_shard x tp ranks in one hop
    return (work.muon_overlap and (fsdp or (lay.tp > 1 and lay.pp == 1))
            and (lay.pp == 1 or not schedule_spec(lay.schedule).split_backward))


def chunk_layers(cfg: ModelConfig, lay: Layout, rank: int) -> list[list[int]]:
    """The layers of each model part (pipeline chunk) of pipeline rank `rank`, as framework/plan/memory.py cuts."""
    n_chunks = lay.pp * lay.virtual
    split = lay.layer_split or (cfg.n_layers // n_chunks,) * n_chunks
    bounds = [sum(split[:c]) for c in range(n_chunks + 1)]
    return [list(range(bounds[c], bounds[c + 1])) for c in stages_of_rank(rank, lay.pp, lay.virtual, lay.schedule)]


def muon_bytes(work: Workload, lay: Layout, rank: int) -> MuonBytes:
    """Muon's terms on pipeline rank `rank` (module docstring)."""
    cfg, prec = work.model, work.precision
    state = prec.master or prec.param  # the momentum is placed like the stored (fp32 master) parameter
    traffic: dict[str, float] = {}
    transient, dense, experts = 0.0, 0, 0
    for layers in chunk_layers(cfg, lay, rank):  # the parts' optimizers step one after another
        transient = max(transient, _part(work, lay, layers, state, traffic))
        for i in layers:
            d, e = layer_units(cfg, i, lay.ep)
            dense += sum(_numel(u) // (lay.tp if split else 1) for u, split, _ in d)
            experts += sum(map(_numel, e))
    index, flops = traffic.pop("index", 0.0), traffic.pop("ns_flops", 0.0)
    gather, owned = traffic.pop("all_gather_tp", 0.0), traffic.pop("owned", 0.0)
    owned_shards = traffic.pop("owned_shards", 0.0)
    # ZeRO shards the momentum like AdamW's moments: dense over dp x cp, experts over dp x tp / ep
    zero = lay.zero_stage > 0
    sharded = dense / (lay.shard_group if zero else 1) + experts / (lay.dp * lay.tp // lay.ep if zero else 1)
    delta = sharded * (state - prec.optimizer)
    if overlapped(work, lay):  # the momentum of the matrices a rank owns, whole, in place of its pieces of them
        delta += (owned - owned_shards) * state
    return MuonBytes(dense + experts, delta, traffic, gather, transient, index, flops, overlapped(work, lay))


__all__ = ["MuonBytes", "chunk_layers", "layer_units", "muon_bytes", "ns_peak"]
