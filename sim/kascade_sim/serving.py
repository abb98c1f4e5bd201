"""Serving inside the simulator: global queues offered to instances, iterations, KV hand-off.

Data flow: a request in its model's global queue (`_wake`) -> an accepting instance's next iteration
(`_kick`: prefill batch or decode step, a live target sharing work with its partner) -> ITER event ->
`_iteration_done` (first tokens; in disaggregated mode the KV waits on its prefiller until
`_dispatch` finds a decoder with room, then a KV event after the transfer) -> decode steps until the
last token. A converted decoder with decodes takes a prompt only when the engine's arrival rule would keep it
(`_converts`: its measured rate finishes it before a prefiller would), and one prefilling a long prompt in chunks
may hand it back to the prefill queue (`_hand_back`, by the engine's own rule). Mixed into `simulator.Simulation`,
whose state it reads and writes.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import takewhile

from kascade_planner.conversion import arrival_verdict, hand_back_verdict, new_prefill_s, remote_prefill_s
from kascade_sim.events import ITER, KV
from kascade_sim.instance import Instance
from kascade_sim.pdpolicy import velocities
from kascade_sim.state import SimState


class Serving(SimState):
    def _wake(self, m: int, role: str, now: float) -> None:
        """Offer the queue to idle instances: serving before live, least loaded first; prefill
        backlog that no prefiller takes goes to idle convertible decoders (busy ones take it after
        their current step)."""
        q = self.queue[(m, role)]
        if not q:
            return
        for i in sorted((i for i in self.group[(m, role)] if i.accepting and not i.busy),
                        key=lambda i: (i.state != "serving", i.load, i.id)):
            self._kick(i, now)
            if not q:
                return
        if role == "prefill" and self.sys.convertible:
            for d in sorted((d for d in self.group[(m, "decode")] if not d.busy), key=lambda d: (d.load, d.id)):
                self._kick(d, now)
                if not q:
                    return

    def _converts(self, inst: Instance, now: float) -> bool:
        """A convertible decoder (TokenScale), once the conversion policy converted it
        (`pdpolicy.apply_conversions` sets `Instance.convertible`), prefills for its own model when
        prefill backlog waits that no idle prefiller takes: the KV is then already where it decodes. A
        decoder not converted prefills only while its model has no prefiller serving (the router's
        fallback: a service without a prefill engine is served by its decoders alone), so a lone
        request needs no prefiller loaded for it. Short prompts are batched up to the chunk budget;
        a longer one is prefilled in chunks of that size (chunked prefill). Prefill and decode steps
        alternate while it has running requests (each prefill step stalls their next token: charged
        to their TBT), and it never converts while prefilled requests wait for a decoder's room."""
        if not self.sys.convertible or inst.role != "decode" or inst.state != "serving" or inst.chunk_left:
            return False
        m = inst.model
        if not inst.convertible and any(p.accepting for p in self.group[(m, "prefill")]):
            return False
        q = self.queue[(m, "prefill")]
        if not q or self.queue[(m, "decode")] or (inst.converted and inst.n_running):
            return False
        r = q[0]
        if (
            inst.kv_reserved + self.inp[r] + self.out[r] > inst.kv_cap
            or inst.n_running + inst.incoming >= self.spec.max_batch
        ):
            return False
        if any(p.accepting and not p.busy for p in self.group[(m, "prefill")]):
            return False
        return self._takes(inst, r)

    def _takes(self, inst: Instance, r: int) -> bool:
        """The engine's arrival rule (`conversion.arrival_verdict`): beside decodes, a decoder takes only a prompt it
        finishes before a prefiller would - a serving one (queue ahead included) or one started now, its load
        included (`_new_prefiller_s`). A converted decoder judges by its measured rate; one prefilling because its
        model has no prefiller (the router's fallback) by the rate its step costs give a prompt beside its decodes."""
        m = inst.model
        if r in self.handed:
            return False
        if not inst.convertible and any(p.accepting for p in self.group[(m, "prefill")]):
            return False
        decodes = inst.n_running + inst.incoming
        if not decodes:
            return True  # an idle decoder prefills at full speed
        rate = inst.rate.rate() if inst.convertible else self._side_rate(inst)
        return arrival_verdict(self.inp[r], rate, self._remote_s(m, r), decodes, self._new_prefiller_s(m, r)) is None

    def _side_rate(self, inst: Instance) -> float:
        """Prompt tokens/s a decoder's chunks get beside its decodes, from its step costs (the engine's stepcost)."""
        chunk = self.sys.convert_chunk_tokens or self.chunk_tokens[inst.model]
        return chunk / (self._prefill_s(chunk) + self._decode_s(max(1, inst.n_running), inst.kv_running))

    def _new_prefiller_s(self, m: int, r: int) -> float | None:
        """What prompt `r` would take on a prefiller not serving yet: one loading (its remaining load), else one
        started now (the model's predicted load, when a slot is free for it), plus the prompts queued ahead of
        it and its own at one prefiller's velocity. None: no prefiller can come."""
        loading = [p.accept_from_s for p in self.group[(m, "prefill")] if p.state == "loading"]
        if loading:
            wait = max(0.0, min(loading) - self._now)
        elif (self._free_slots() > (0 if any(d.active for d in self.group[(m, "decode")]) else 1)
              and sum(1 for p in self.group[(m, "prefill")] if p.active) < self.max_instances):
            wait = self._load_estimate(m)
        else:
            return None
        ahead = sum(self.inp[x] for x in takewhile(lambda x: self.arr[x] < self.arr[r], self.queue[(m, "prefill")]))
        return new_prefill_s(wait, ahead + self.inp[r], velocities(self, m).prefill_effective)

    def _chunk_tokens(self, inst: Instance) -> int:
        """Prompt tokens per converted prefill step: the conversion policy's chunk budget (or
        `System.convert_chunk_tokens` when set) while the decoder has running requests (their next
        token waits for the step), a full prefill batch when not."""
        if not inst.n_running:
            return self.spec.max_prefill_tokens
        return self.sys.convert_chunk_tokens or self.chunk_tokens[inst.model]

    def _hand_back(self, inst: Instance, now: float) -> bool:
        """TokenScale's hand-back as the engine does it (kascade_engine.pd.handback): once per hand-back bound a
        converted decoder weighs the long prompt it prefills in chunks with `hand_back_verdict`, against what a
        prefill on a prefiller takes now (`_remote_s`). Handed back, the prompt leaves it (partial prefill
        dropped, KV reservation freed) for the prefill queue at its arrival, where only a prefiller takes it."""
        bound = self.hand_back_s[inst.model]
        if bound is None or now - inst.chunk_seen_at < bound:
            return False
        r, m = inst.chunk_req, inst.model
        done = self.inp[r] - inst.chunk_left
        if hand_back_verdict(inst.chunk_left, done - inst.chunk_seen, now - inst.chunk_seen_at,
                             self._remote_s(m, r)) is None:
            inst.chunk_seen, inst.chunk_seen_at = done, now
            return False
        inst.kv_reserved -= self.inp[r] + self.out[r]
        inst.chunk_req, inst.chunk_left = -1, 0
        self.converted_prefills -= 1
        self.handed.add(r)
        q = self.queue[(m, "prefill")]
        q.insert(bisect_right(q, self.arr[r], key=lambda x: self.arr[x]), r)
        return True

    def _remote_s(self, m: int, r: int) -> float | None:
        """What prompt `r` of model `m` is expected to take on a prefiller, by the engine's estimate
        (`conversion.remote_prefill_s`, as `RemotePrefill.expected_s`): the prompt tokens ahead of it (in the
        prefillers' batches, and queued for them before its arrival: counted whole, as the engine does) and its own
        at the serving prefillers' measured pace (the sum of their rates: they share the queue), never under the
        moving average of recent ones (arrival to first token). The simulator's prefill queue is global: unlike a
        decode engine, which sees only what it sent itself, the decoder here sees everything ahead, so no wait
        stands in for prompts it cannot see (no `waited_s`). None: nothing measured yet."""
        pre = [p for p in self.group[(m, "prefill")] if p.accepting]
        rates = [x for x in (p.rate.rate() for p in pre) if x]
        ahead = sum(self.inp[x] for p in pre for x in p.batch)
        # the queue is in arrival order (a handed-back prompt goes back at its arrival): stop at the first after `r`
        ahead += sum(self.inp[x] for x in takewhile(lambda x: self.arr[x] < self.arr[r], self.queue[(m, "prefill")]))
        return remote_prefill_s(self.prefill_took.get(m), [], ahead + self.inp[r], sum(rates) if rates else None)

    def _prefill_chunk(self, inst: Instance, now: float) -> None:
        """One chunk of a long prompt on a converted decoder (its KV was reserved at the first chunk);
        the last chunk yields the first token. Charged as a prefill of the chunk's tokens (the
        roofline has no attention term, so later chunks cost the same as the first)."""
        n = min(self._chunk_tokens(inst), inst.chunk_left)
        inst.chunk_left -= n
        dur = self.spec.cost.prefill_s(n) + inst.debt_s
        inst.debt_s = 0.0
        inst.batch = [inst.chunk_req] if inst.chunk_left == 0 else []
        inst.decoding, inst.busy, inst.converted = False, True, True
        if inst.convertible:
            inst.rate.observe(n, dur)
        self.busy_time[(inst.model, "prefill")] += dur
        inst.busy_until = now + dur
        self.push(now + dur, ITER, inst)

    def _measure(self, inst: Instance, dur: float) -> None:
        """The prefill rate an engine would report for this iteration (kascade_engine.batch.velocity, the same meter):
        a prefiller's steps while prompts wait; a converted decoder's prefill steps, its decode steps between the
        chunks of a prompt (0 tokens: the prompt waited), and its other decode steps as what a prompt would get
        beside them (the chunk budget, its prefill time added: the engine's `known_room`). The simulator's
        conversion policy reads the ratio (`pdpolicy.conversion_input`), as the operator does the engines'."""
        tokens = sum(self.inp[r] for r in inst.batch)
        if inst.role == "prefill":
            if tokens or self.queue[(inst.model, "prefill")]:
                inst.rate.observe(tokens, dur)
        elif inst.role == "decode" and inst.convertible:
            if inst.converted:
                inst.rate.observe(tokens, dur)
            elif inst.chunk_left:
                inst.rate.observe(0, dur)
            else:
                room = self._chunk_tokens(inst)
                inst.rate.observe(room, dur + self._prefill_s(room))

    def _dispatch(self, m: int, now: float) -> None:
        """Prefilled requests to decoders with room for their whole KV (never past capacity)."""
        q = self.queue[(m, "decode")]
        if not q:  # the common case (called after every iteration): nothing waits for a decoder
            return
        decoders = [i for i in self.group[(m, "decode")] if i.accepting]
        while q and decoders:
            r = q[0]
            need = self.inp[r] + self.out[r]
            fit = [
                i
                for i in decoders
                if i.kv_reserved + need <= i.kv_cap and i.n_running + i.incoming < self.spec.max_batch
            ]
            if not fit:
                return
            # Packed, not spread: a decode step is memory-bound (nearly as long for 1 request as
            # for 30) and a decoder with any request is busy, so spreading keeps every decoder
            # busy with a few requests; packing lets the extra ones empty and be scaled down.
            d = min(fit, key=lambda i: (i.state != "serving", -(i.n_running + i.incoming), i.id))
            q.popleft()
            d.reserve(need)
            d.incoming += 1
            h = self.holder.pop(r)
            h.kv_reserved -= need
            self.push(now + self.inp[r] * self.spec.kv_bytes_per_token / self.kv_bytes_per_s, KV, (r, d))
            if h.state == "draining":
                self._maybe_release(h, now)
            elif not h.busy:
                self._kick(h, now)

    def _kv_arrived(self, r: int, d: Instance, now: float) -> None:
        d.incoming -= 1
        d.add_running(r, self.inp[r], self.out[r])
        self._kick(d, now)

    def _kick(self, inst: Instance, now: float) -> None:
        state = inst.state  # the hot path: one read instead of the `accepting` property's two
        if inst.busy or state not in ("live", "serving", "draining"):
            return
        if inst.chunk_left and not (inst.converted and inst.n_running):
            if not self._hand_back(inst, now):
                self._prefill_chunk(inst, now)  # a long prompt's next chunk (decode steps in between)
                return
            self._wake(inst.model, "prefill", now)  # a prefiller may take it now
            if inst.busy:  # the wake kicked this decoder already
                return
        partner = inst.partner if state == "live" else None
        take = state != "draining" and inst.role != "decode" and (partner is None or partner.debt_s == 0)
        queue_role = inst.role
        if not take and self.sys.convertible and self._converts(inst, now):
            q = self.queue[(inst.model, "prefill")]
            if self.inp[q[0]] > self._chunk_tokens(inst):
                r = q.popleft()
                inst.reserve(self.inp[r] + self.out[r])
                inst.chunk_req, inst.chunk_left = r, self.inp[r]
                inst.chunk_seen, inst.chunk_seen_at = 0, now
                self.converted_prefills += 1
                self._prefill_chunk(inst, now)
                return
            take, queue_role = True, "prefill"
        spec = self.spec
        budget = self._chunk_tokens(inst) if queue_role != inst.role else spec.max_prefill_tokens
        dur = inst.next_iteration(now, self.queue[(inst.model, queue_role)], self.inp, self.out, self._prefill_s,
                                  self._decode_s, budget, spec.max_batch, take)
        inst.converted = queue_role != inst.role and bool(inst.batch)
        if inst.converted:
            self.converted_prefills += len(inst.batch)
        if dur is None:
            self._maybe_release(inst, now)
            return
        if partner is not None:
            # ZigZag: the layers not yet resident run on the partner, which pays for them next.
            # Only the part of the iteration before the target holds every layer is shared.
            owed = (1.0 - inst.live_share) * min(dur, max(0.0, inst.ready_s - now))
            partner.debt_s += owed
            self.max_debt_s = max(self.max_debt_s, partner.debt_s)
            # The batch's tokens exist only once those layers ran: on the partner, after the step it is in (if
            # any) and the work it owes (its debt is paid first thing in its next step), or on the target itself
            # once it holds every layer. Finishing at the target's own pace put first tokens up to seconds before
            # the work was done.
            if owed > 0:
                by_partner = (partner.busy_until if partner.busy else now) + partner.debt_s
                dur = max(dur, min(by_partner, max(now, inst.ready_s) + owed) - now)
            if not partner.busy:
                self._kick(partner, now)
        if self.sys.convertible:
            self._measure(inst, dur)
        # A converted decoder's prefill counts as prefill work (the prefill policy sees it).
        self.busy_time[(inst.model, "prefill" if inst.converted else inst.role)] += dur
        inst.busy_until = now + dur
        self.push(now + dur, ITER, inst)

    def _finished(self, m: int, r: int, now: float) -> None:
        """Request `r` finished: its output length joins the model's history (cumulative, in time order)."""
        h = self.finished[m]
        tok, n = h[-1][1:] if h else (0.0, 0.0)
        h.append((now, tok + self.out[r], n + 1))

    def _iteration_done(self, inst: Instance, now: float) -> None:
        inst.busy = False
        m = inst.model
        if inst.batch:
            for r in inst.batch:
                self.first[r] = now
                self.served_by[r] = inst.id
                if self.out[r] <= 1:
                    self.last[r] = now
                    self.unfinished -= 1
                    self._finished(m, r, now)
                    inst.kv_reserved -= self.inp[r] + self.out[r]
                elif inst.role == "prefill":
                    self.holder[r] = inst  # its KV stays here until a decoder has room
                    took = self.prefill_took.get(m)
                    self.prefill_took[m] = (
                        now - self.arr[r] if took is None else took + 0.3 * (now - self.arr[r] - took)
                    )
                    self.queue[(m, "decode")].append(r)
                else:
                    inst.add_running(r, self.inp[r], self.out[r])
            inst.batch = []
        elif inst.decoding:
            for r in inst.decode_done():
                self.last[r] = now
                self.unfinished -= 1
                self._finished(m, r, now)
                inst.kv_reserved -= self.inp[r] + self.out[r]
                inst.kv_running -= self.inp[r] + self.out[r]
        if inst.live_target is not None and not inst.live_target.busy:
            self._kick(inst.live_target, now)
        self._kick(inst, now)
        if self.cfg.mode == "disaggregated":
            self._dispatch(m, now)

