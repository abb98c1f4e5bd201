"""Scaling actions inside the simulator: where a new instance goes, how its weights arrive, when it
may serve, and how instances are released.

Data flow: a scale decision (from `autoscaler`) -> GPUs picked (`_pick_node`, preempting another
model's idle instance when the cluster is full) -> the planner's `make_plan` (chain, binomial or a
local load) and cost model -> every block's arrival time per target -> ACCEPT / READY events, live
pairs (`pair_live`, ZigZag share from `ilp_free`) -> later, `_scale_down` / `_maybe_release` free the
GPUs. Mixed into `simulator.Simulation`, whose state it reads and writes.
"""

from __future__ import annotations

import math

from kascade_planner.builder import make_plan
from kascade_planner.cost import predict
from kascade_planner.plan import Instance as PlanInstance
from kascade_planner.zigzag import PairSetting, ilp_free
from kascade_sim.events import ACCEPT, READY
from kascade_sim.instance import Instance
from kascade_sim.result import ScaleEvent
from kascade_sim.state import SimState


class Scaling(SimState):
    def _pick_node(self, m: int) -> str | None:
        tp = self.spec.tp
        cands = [n for n, f in self.free.items() if f >= tp]
        if not cands:
            return None
        if self.sys.host_cache == "ttl":  # ServerlessLLM is locality-aware: prefer hosts with a warm copy
            now = self._now
            return min(cands, key=lambda n: (not self.hostmem.warm(n, m, now), -self.free[n], n))
        return min(cands, key=lambda n: (-self.free[n], n))

    def _free_slots(self) -> int:
        return sum(f // self.spec.tp for f in self.free.values())

    def _load_estimate(self, m: int) -> float:
        """Seconds until a new instance of model `m` serves: the planner's prediction for its last scale-up (its
        first layer with a live partner, else its last block), or before any, for one target fed from the model's
        serving instances or its host copy (`_load_s`, set by `_scale_up`)."""
        est = self._load_s.get(m)
        if est is None:
            node = self._pick_node(m) or self.topo.nodes[0].name
            src = [
                PlanInstance(i.id, i.node, i.gpus)
                for g in self.roles
                for i in self.group[(m, g)]
                if i.state == "serving"
            ] or [PlanInstance(f"host:pool:{m}", self._pool_node(m), self.spec.tp, "host")]
            plan = make_plan(self.topo, self.layout, src, [PlanInstance("probe", node, self.spec.tp)], "chain",
                             predict=False)
            blocks = dict(dict(predict(plan, self.topo).arrival)["probe"])
            live = self.sys.serving == "live" and len(src) > 0 and src[0].kind == "gpu"  # a serving partner exists
            est = self._load_s[m] = max(blocks["layer.0"], blocks["embed"]) if live else max(blocks.values())
        return est

    def _pool_node(self, m: int) -> str:
        return self.topo.nodes[m % len(self.topo.nodes)].name

    def _host_copies(self, now: float) -> int:
        if self.sys.host_cache == "all":
            return len(self.topo.nodes) * self.models
        if self.sys.host_cache == "one":
            return self.models
        if self.sys.host_cache == "ttl":
            return self.hostmem.count(now)
        return 0

    def _new_instance(self, node: str, m: int, role: str, now: float, state: str = "loading") -> Instance:
        self.free[node] -= self.spec.tp
        self.gpus_allocated += self.spec.tp
        inst = Instance(f"i{self.next_id}", node, self.spec.tp, now, self.kv_cap, m, role, state)
        self.next_id += 1
        self.instances.append(inst)
        self.group[(m, role)].append(inst)
        return inst

    def _preempt_idle(self, now: float, m: int, role: str) -> bool:
        """A group with no instance at all needs a GPU and none is free: release the idle instance
        (no batch, no KV) of another group that has been up longest; False when there is none."""
        floor = self.states[(m, role)].bounds.min
        idle = [i for (gm, gr), grp in self.group.items() if (gm, gr) != (m, role)
                and sum(1 for j in grp if j.active) > max(floor, 0)
                for i in grp if i.state == "serving" and not i.busy and not i.n_running and not i.kv_reserved
                and not i.incoming and i.live_target is None and (gr != "decode" or not self._needs_decoder(gm, grp))]
        if not idle:
            # Nothing idle: drain the least loaded prefiller of a group that has several (it finishes
            # its batch, then frees its GPUs), so a model is not starved while others keep growing.
            # One at a time: a prefiller already draining will free GPUs soon.
            if any(i.state == "draining" for (_, gr), grp in self.group.items() if gr != "decode" for i in grp):
                return False
            spare = [i for (gm, gr), grp in self.group.items() if (gm, gr) != (m, role) and gr != "decode"
                     and sum(1 for j in grp if j.active) > max(floor, 1)
                     for i in grp if i.state == "serving" and i.live_target is None]
            if spare:
                v = min(spare, key=lambda i: (i.load, i.alloc_s, i.id))
                v.state, v.preempted = "draining", True
                self._maybe_release(v, now)
                self.events.append(ScaleEvent(now, "down", 1, f"preempted (draining): model {m} {role} has no "
                                              "instance and no free GPU", 0.0, v.role, v.model))
            return False
        v = min(idle, key=lambda i: (i.alloc_s, i.id))
        v.state = "draining"
        self._maybe_release(v, now)
        self.events.append(ScaleEvent(now, "down", 1, f"preempted: model {m} {role} has no instance and no free GPU",
                                      0.0, v.role, v.model))
        return True

    def _needs_decoder(self, m: int, decoders: list[Instance]) -> bool:
        """Model `m`'s last active decoder is not preempted while prefilled KV waits for it or a prefiller
        may produce some (a prompt still waiting for a prefiller does not hold it: a model holding a
        decoder while it waits for a prefiller slot, in every model at once, would be a deadlock too)."""
        return bool(self.queue[(m, "decode")]) or (
            sum(1 for d in decoders if d.active) <= 1 and any(p.active for p in self.group[(m, "prefill")]))

    def _scale_up(self, now: float, m: int, role: str, count: int, reason: str) -> None:
        # Instances still draining are loaded already: take them back first.
        back = [i for i in self.group[(m, role)] if i.state == "draining" and not i.preempted][:count]
        for d in back:
            d.state = "serving"
            count -= 1
            self._kick(d, now)
        if back:  # a scale-up too, with nothing to load
            self.events.append(ScaleEvent(now, "up", len(back), reason, 0.0, role, m, loaded=False))
        targets: list[Instance] = []
        # A prefiller of a model with no decoder leaves a slot for one: prefillers of several models
        # each holding KV for a decoder that can no longer be placed would wait on each other forever.
        keep = 1 if role == "prefill" and not any(d.active for d in self.group[(m, "decode")]) else 0
        for _ in range(count):
            node = self._pick_node(m) if self._free_slots() > keep else None
            if node is None and not self.arbitrated and not any(i.active for i in self.group[(m, role)]) \
                    and self._preempt_idle(now, m, role):
                node = self._pick_node(m) if self._free_slots() > keep else None
            if node is None:
                break
            targets.append(self._new_instance(node, m, role, now))
        if not targets:
            return
        ptargets = [PlanInstance(t.id, t.node, t.gpus) for t in targets]
        serving = [i for g in self.roles for i in self.group[(m, g)] if i.state == "serving"]
        self.loads += len(targets)
        pairs: dict[str, Instance] = {}
        if self.sys.transfer == "local":
            if self.sys.host_cache == "ttl":
                cached = [t.node for t in targets if self.hostmem.lookup(t.node, m, now)]
            else:
                cached = [n.name for n in self.topo.nodes]
            plan = make_plan(self.topo, self.layout, (), ptargets, "local", host_cached_nodes=cached, predict=False)
            for t in targets:
                t.from_ssd = t.node not in cached
                if not t.from_ssd and self.sys.host_cache == "ttl":
                    self.hostmem.in_use(t.node, m, now)
        else:
            sources = [PlanInstance(i.id, i.node, i.gpus) for i in serving]
            if self.sys.host_cache == "one" or not sources:
                sources.append(PlanInstance(f"host:pool:{m}", self._pool_node(m), self.spec.tp, "host"))
            # KV flows prefill -> decode must not share links with weight transfers (source pruning).
            kv = [(p.id, d.id) for p in serving if p.role == "prefill" for d in serving if d.role == "decode"]
            live = self.sys.serving == "live"
            # Any serving instance of the model without a live target may partner (it holds every
            # layer); the overloaded ones of the scaled role first.
            free_partners = [i for i in serving if i.live_target is None]
            hot = sorted((i for i in free_partners if i.role == role), key=lambda i: (-i.load, i.id))
            plan = make_plan(self.topo, self.layout, sources, ptargets, self.sys.transfer, kv_flows=kv,
                             overloaded=[i.id for i in hot], predict=False, live=True if live else None)
            if live:
                by_id = {i.id: i for i in free_partners}
                pairs = {t: by_id[s] for s, t in plan.live_pairs if s in by_id}  # one to one
        arrival = dict(predict(plan, self.topo).arrival)
        per_target = {t.id: dict(arrival[t.id]) for t in targets}  # block -> arrival, built once per target
        joint = max(min(per_target[t.id][b] for t in targets) for b in self.layout.block_ids)
        for t in targets:
            t.solo = len(targets) == 1 or self.sys.transfer == "local"
            blocks = per_target[t.id]
            t.block_times = sorted(now + s for s in blocks.values())
            t.ready_s = t.block_times[-1]
            partner = pairs.get(t.id)
            if partner is not None:
                t.accept_from_s = now + max(blocks["layer.0"], blocks["embed"])
                t.partner, partner.live_target = partner, t
                self.pairings.append((now, partner.id, t.id, t.ready_s))
                t.live_share = self._live_share(partner, t.ready_s - now)
            elif self.sys.serving == "pipeline" and len(targets) > 1:
                t.accept_from_s = now + joint
                t.slow = 1.0 + self.sys.pipeline_overhead
            else:
                t.accept_from_s = t.ready_s
            t.accept_from_s = min(t.accept_from_s, t.ready_s)
            self.push(t.accept_from_s, ACCEPT, t)
            self.push(t.ready_s, READY, t)
        self.cache_peak = max(self.cache_peak, self._host_copies(now))
        makespan = max(t.ready_s for t in targets) - now
        # what waiting for a new instance costs a prompt: until the first target accepts (live: its first layer)
        self._load_s[m] = min(t.accept_from_s for t in targets) - now
        self.events.append(ScaleEvent(now, "up", len(targets), reason, round(makespan, 6), role, m))

    def _live_share(self, partner: Instance, load_s: float) -> float:
        """Share of the layer work a loading target takes over from its partner, from the planner's
        ILP-free ZigZag schedule of the partner's queue (load time per layer in layer computations)."""
        c = self.spec.cost
        batch_s = c.decode_s(max(1, partner.n_running), partner.kv_running)
        q = self.queue[(partner.model, partner.role)]
        if q and partner.role != "decode":
            batch_s = max(
                batch_s, c.prefill_s(min(self.spec.max_prefill_tokens, sum(self.inp[r] for r in list(q)[:16])))
            )
        # The schedule's share depends on the load time per layer in layer computations, not on the
        # layer count: solved on at most 16 layers and 6 batches, log-bucketed so a run reuses a
        # handful of schedules (each costs milliseconds).
        layers = min(16, self.spec.layers)
        ratio = load_s / batch_s
        waiting = len(q) + partner.load
        key = (round(math.log2(max(ratio, 1e-3)) * 2) / 2, max(1, min(6, waiting)))
        if key not in self._zigzag:
            sched = ilp_free(PairSetting(layers, 2 ** key[0], key[1]))
            self._zigzag[key] = sum(sched.target_layers) / (key[1] * layers)
        return self._zigzag[key]

    def _scale_down(self, now: float, m: int, role: str, count: int, reason: str) -> None:
        # The policy counts loading instances, so it may release them too: an idle one still loading
        # has its load cancelled (only when no other target's blocks pass through it). Otherwise a
        # scale-down decided while the only candidate loads would be dropped, its delay restarted,
        # and an idle instance kept until its load ends plus another delay. Loading ones go first
        # (they are furthest from useful), then the least loaded.
        cands = sorted((i for i in self.group[(m, role)]
                        if (i.state == "serving" and i.live_target is None) or i.cancellable),
                       key=lambda i: (i.load, i.state == "serving", -i.alloc_s, i.id))
        victims = cands[:count]
        for v in victims:
            v.state = "draining"
            self._maybe_release(v, now)
        if victims:
            self.events.append(ScaleEvent(now, "down", len(victims), reason, 0.0, role, m))

    def _maybe_release(self, inst: Instance, now: float) -> None:
        if inst.state != "draining" or inst.busy or inst.n_running or inst.kv_reserved or inst.debt_s:
            return
        inst.state = "released"
        inst.released_s = now
        if inst.partner is not None:  # a cancelled live target frees its partner for another pair
            inst.partner.live_target = None
            inst.partner = None
        self.free[inst.node] += inst.gpus
        self.gpus_allocated -= inst.gpus
        self.group[(inst.model, inst.role)].remove(inst)
        if self.sys.host_cache == "ttl":
            self.hostmem.released(inst.node, inst.model, now)

