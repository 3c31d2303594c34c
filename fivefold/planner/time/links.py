"""Which links a layout's groups cross and what a call on them costs (`steptime` reads them): a
group that spans two nodes runs on the network, else over NVLink; an EP all-to-all across nodes is
split between the two, and the flex dispatcher sends a token once per node it is routed to
(`nodes_hit`)."""
from __future__ import annotations

from functools import lru_cache
from math import comb

from fivefold.planner.layout import Plan
from fivefold.planner.presets.hardware import Hardware
from fivefold.planner.time.time_assumptions import TimeAssumptions
from fivefold.topology import Topology, dense_grid, expert_grid, parse_order, split_group


def _spans_nodes(topo: Topology, dims: str, world: int, gpn: int) -> bool:
    """Whether the group over `dims` of rank 0 or of the last rank holds ranks of two nodes. Its ranks
    lie between its lowest and its highest, `span` apart (every coordinate over `dims` from 0 to its
    last), so it does exactly when those two do: arithmetic, never listing a 512-rank DP group. Rank 0's
    group runs from 0 up, the last rank's down to the last rank."""
    span = sum((topo.sizes[d] - 1) * topo.strides[d] for d in parse_order(dims))
    return span >= gpn or (world - 1 - span) // gpn != (world - 1) // gpn


_CROSS: dict[tuple, tuple[dict, dict]] = {}
"""Layout sizes, order and GPUs per node -> which groups cross nodes, and each group's link by name
(the search asks once per layout)."""


def _crossings(plan: Plan, gpn: int) -> tuple[dict, dict[str, str]]:
    """Which of the plan's groups span two nodes (and "ep local": how many of an EP group's ranks
    share rank 0's node), and each group's link by name."""
    order = plan.config.parallel.order
    dense = _dense_crossings(plan.tp, plan.cp, plan.dp, plan.pp, order, gpn)
    expert = _expert_crossings(plan.etp, plan.ep, plan.edp, plan.pp, order, gpn)
    cross = {"tp": dense["tp"], "cp": dense["cp"], "pp": dense["pp"], "dp": dense["dp"], "ep": expert["ep"],
             "etp": expert["etp"], "edp": expert["edp"]}
    cross["embedding"] = cross["pp"]  # the first and last pipeline ranks
    cross["tp-cp"] = dense["tp-cp"]
    cross["ep local"] = min(plan.ep, expert["ep local"])
    if plan.instances > 1:  # HSDP (fivefold.runtime.mesh.split): DP x CP cut into shard pieces and replicate groups
        d = dense_grid(plan.tp, plan.cp, plan.dp, plan.pp, order)
        pieces = [split_group(ranks, plan.instances) for ranks in d.groups("cp-dp")]
        cross["dp"], cross["dp-replicate"] = (any(g[-1] // gpn != g[0] // gpn for split in pieces for g in split[kind])
                                              for kind in (0, 1))
    return cross, {g: "network" if v else "intra-node" for g, v in cross.items() if g != "ep local"}


@lru_cache(maxsize=None)
def _dense_crossings(tp: int, cp: int, dp: int, pp: int, order: str, gpn: int) -> dict[str, bool]:
    """Which groups of the dense grid span two nodes: shared by the layouts that differ in EP / ETP alone."""
    d = dense_grid(tp, cp, dp, pp, order)
    return {g: _spans_nodes(d, dims, d.world_size, gpn)
            for g, dims in (("tp", "tp"), ("cp", "cp"), ("pp", "pp"), ("dp", "cp-dp"), ("tp-cp", "tp-cp"))}


@lru_cache(maxsize=None)
def _expert_crossings(etp: int, ep: int, edp: int, pp: int, order: str, gpn: int) -> dict[str, bool | int]:
    """Which groups of the expert grid span two nodes, and "ep local": at most how many EP ranks share
    rank 0's node (its EP group is 0, stride, 2 stride, ...; `_crossings` takes at most EP of them)."""
    e = expert_grid(etp, ep, edp, pp, order)
    out: dict[str, bool | int] = {g: _spans_nodes(e, g, e.world_size, gpn) for g in ("ep", "etp", "edp")}
    out["ep local"] = (gpn - 1) // e.strides["ep"] + 1
    return out


@lru_cache(maxsize=None)
def nodes_hit(experts: int, topk: int, groups: int, chosen: int, nodes: int) -> float:
    """Expected number of the `nodes` (each holding experts / nodes consecutive experts) one token's
    `topk` experts fall on, under balanced routing limited to `chosen` of `groups` expert groups
    (groups = chosen = 1: unlimited): DeepEP's / HybridEP's sends per token. Against the router
    (`fivefold.model.router.top_k` on random logits, tests/test_calibration.py): within 1% where a node
    holds whole groups or routing is unlimited; where a group spans nodes each chosen group is taken to
    hold topk / chosen of the token's experts, 6% above the router's less even picks."""
    per_node = experts // nodes
    if groups > 1 and groups % nodes == 0:  # a node holds whole groups: it is hit when one is chosen
        q = groups // nodes
        p = 1 - comb(groups - q, chosen) / comb(groups, chosen)
    elif groups > 1 and nodes % groups == 0 and topk % chosen == 0:
        # a group spans nodes: its group chosen, and one of its topk / chosen experts (groups are
        # chosen by their best topk / chosen scores) on the node
        per_group, take = experts // groups, topk // chosen
        p = chosen / groups * (1 - comb(per_group - per_node, take) / comb(per_group, take))
    else:
        p = 1 - comb(experts - per_node, topk) / comb(experts, topk)
    return nodes * p


class Links:
    def __init__(self, plan: Plan, hw: Hardware, gpn: int, ta: TimeAssumptions):
        key = (plan.tp, plan.cp, plan.pp, plan.dp, plan.ep, plan.etp, plan.config.parallel.order, gpn, plan.instances)
        self.hw, self.ta = hw, ta
        got = _CROSS.get(key)
        if got is None:
            got = _CROSS[key] = _crossings(plan, gpn)
        self.cross, self.names = got
        # the flex dispatcher (DeepEP / HybridEP) sends a token across nodes once per node it is routed to,
        # then over NVLink to that node's experts: its network bytes per expert copy's (group-limited
        # routing, DeepSeek-V3's node-limited moe_router_group_topk, bounds those nodes: `nodes_hit`)
        self.ep_copies = 1.0
        m = plan.config.model
        if plan.config.parallel.moe_token_dispatcher_type == "flex" and m.is_moe and self.cross["ep"] and plan.ep > 1:
            nodes = plan.ep // self.cross["ep local"]
            if m.num_experts % nodes == 0:
                groups = m.moe_router_num_groups if m.moe_router_group_topk else 1
                self.ep_copies = min(1.0, nodes_hit(m.num_experts, m.moe_router_topk, groups,
                                                    m.moe_router_group_topk or 1, nodes) / m.moe_router_topk)

    def name(self, g: str) -> str:
        return self.names[g]

    def time(self, g: str, bytes_sent: float, steps: int, n: int = 0, kind: str = "all_to_all") -> float:
        """Seconds of a call of `g` (n ranks) that sends `bytes_sent` from each rank. An all-to-all
        over EP that crosses nodes sends the share of its peers outside the node over the network
        and the rest over NVLink at once (uniform routing): the slower of the two; with the flex
        dispatcher once per node hit, not per copy (`ep_copies`). Other calls (a ring) run at the
        slowest link of their group."""
        bw = self.hw.network_bw if self.cross[g] else self.hw.intra_node_bw
        lat = self.ta.network_latency if self.cross[g] else self.ta.intra_latency
        if g == "ep" and kind == "all_to_all" and self.cross[g] and n > 1:
            local = self.cross["ep local"]
            outside = (n - local) / (n - 1)
            bw_time = max(bytes_sent * outside * self.ep_copies / self.hw.network_bw,
                          bytes_sent * (1 - outside) / self.hw.intra_node_bw)
            return bw_time / self.ta.comm_efficiency + steps * lat
        return bytes_sent / (bw * self.ta.comm_efficiency) + steps * lat
