"""The scheduler: continuous batching with chunked prefill and preemption by recompute.

Each step has a token budget (`max_num_batched_tokens`) and runs the lanes in order (vLLM's
`schedule`, once per lane): a lane's running requests first, in arrival order, each taking what it
still needs (1 token when decoding, a chunk of its prompt when prefilling), then its waiting
requests, admitted in order while budget, `max_num_seqs` and free blocks allow — and not in a step
that had to preempt. When KV blocks run out, the most recently admitted running request of the
last lane that has one is preempted: its blocks are freed and it waits at the front of its queue,
to be recomputed from token 0 (its outputs so far become part of what is recomputed).

Caches at admission (`admission_planner.py`, decided before anything changes): the prefix cache
(`prefix_hits.py`: full-block hits, then an identical prompt's last block or the reusable leading
part of a computed block, copied by the runner before the step) and the encoder cache
(`encoder_planner.py`: a chunk that reaches an item's placeholders references its output,
resident or encoded this step within the encoder budget, until it has computed them all). Blocks
join the prefix cache as soon as the scheduled tokens fill them; finished, aborted and preempted
requests free their blocks into the LRU queue, keys kept, and release their encoder references
(unused outputs stay resident until the cache needs room).

Policies (`policies/`), each behind a few calls:
- lanes (`policies/lane.py`): the users' lane in fair-share order (`policies/fairness.py: FairLane`,
  which also preempts a request over its share before the step; with `--scheduling-policy priority`
  by priority first, `policies/priority.py: PriorityLane`), then the cache verifier's shadow
  requests (`policies/shadows.py: ShadowLane`);
- first tokens (`policies/first_tokens.py: FirstTokenAnswers`): an admission whose prefix hits
  reach an identical prompt's last block may be answered with that prompt's first token, computing
  nothing;
- n > 1 (`policies/siblings.py: SiblingGroups`): a request's later completions are held until its
  first has scheduled its whole prompt, then queue where its blocks and encoder outputs are hits.
"""

from __future__ import annotations

from typing import Sequence

from mmserve.config import SchedulerConfig, compute_encoder_budget
from mmserve.engine.admission_planner import AdmissionPlanner
from mmserve.engine.encoder_cache import EncoderCacheManager
from mmserve.engine.encoder_planner import EncoderPlan, EncoderPlanner
from mmserve.engine.kv_cache import KVBlock, KVCacheManager
from mmserve.engine.policies.fairness import FairLane
from mmserve.engine.policies.first_tokens import FirstTokenAnswers, FirstTokenCache
from mmserve.engine.policies.lane import Lane, Lanes
from mmserve.engine.policies.priority import PriorityLane
from mmserve.engine.policies.shadows import ShadowLane
from mmserve.engine.policies.siblings import SiblingGroups
from mmserve.engine.prefix_hits import PrefixHits
from mmserve.engine.request import Request, RequestStatus
from mmserve.engine.runner_mirror import RunnerMirror
from mmserve.engine.unfinished_steps import UnfinishedSteps
from mmserve.ipc.messages import EngineCoreOutput, EngineCoreOutputs, TokenLogprobs
from mmserve.ipc.worker_messages import ModelRunnerOutput, SchedulerOutput


class Scheduler:
    """`max_item_tokens`: the model's largest item in embedding tokens (it sizes the encoder
    budgets, see `compute_encoder_budget`; a ValueError when the config cannot run one)."""

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, max_model_len: int,
                 max_item_tokens: int = 0, first_tokens: FirstTokenCache | None = None) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        # a first token needs the prompt's last block: off with last-block caching
        self.answers = FirstTokenAnswers(first_tokens if first_tokens is not None and kv_cache.cache_last_blocks
                                         else FirstTokenCache(1, enabled=False))
        compute_budget, cache_size = compute_encoder_budget(config, max_item_tokens)
        self.encoder_cache = EncoderCacheManager(cache_size, keep_unused=config.encoder_cache_tokens != 0)
        self.encoder_planner = EncoderPlanner(self.encoder_cache, compute_budget, not config.disable_chunked_mm_input)
        self.prefix = PrefixHits(kv_cache, self.encoder_cache.contains)
        self.admission = AdmissionPlanner(kv_cache, self.prefix, self.answers, self.encoder_planner)
        self.requests: dict[str, Request] = {}
        self.groups = SiblingGroups()
        self.users = (PriorityLane if config.scheduling_policy == "priority" else FairLane)(config.max_num_seqs)
        self.shadow_lane = ShadowLane()
        self.lanes = Lanes(self.users, self.shadow_lane)
        self.waiting = self.users.waiting  # the users' waiting requests, in the order they are admitted
        self.shadows = self.shadow_lane.waiting
        self.first_tokens = self.answers.cache
        self.running: list[Request] = []  # every lane's, in admission order
        self.runner = RunnerMirror(kv_cache)  # what the model runner holds of each request
        self.num_preemptions = 0  # since start, for tests and metrics
        self.unfinished = UnfinishedSteps()  # scheduled, not yet updated from (--async-scheduling: two)
        self._arrivals = 0  # requests added since start: the next one's `order`

    def _running_in(self, lane: Lane) -> list[Request]:
        """`lane`'s running requests, in the order it schedules them (`Lane.in_turn`)."""
        return self.lanes.in_turn(lane, self.running)

    # ---- requests in and out ----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; a ValueError (and no change) when one of its items can never run."""
        self.encoder_planner.check_fits(request, self.config.max_num_batched_tokens)
        request.order = self._arrivals
        self._arrivals += 1
        if request.sampling_params.n > 1:
            request = self.groups.split(request)
        self.requests[request.request_id] = request
        self.lanes.of(request).waiting.append(request)

    def has_request(self, request_id: str) -> bool:
        """Whether the id names an unfinished request (or one of an n > 1 request's completions)."""
        return request_id in self.requests or self.groups.contains(request_id)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """End requests from outside the step (abort, stop string); unknown ids are ignored. A
        request's id ends all its completions, a sibling's id (`sibling_request_id`) that one."""
        request_ids, _ = self.groups.expand(request_ids)
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.status.finished:
                continue
            self._unqueue(req)
            self._finish(req, status)

    def _unqueue(self, req: Request) -> None:
        """Take unfinished `req` out of `running` or its lane's queue (preempted with a token in flight)."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.lanes.of(req).waiting.remove(req)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.running) + self.lanes.num_waiting()

    # ---- one step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step: per lane, running requests first (preempting when KV blocks run out),
        then waiting ones; `free_encoder_ids` carries the encoder outputs dropped since the last step."""
        out = SchedulerOutput([], [], {}, {}, [], self.runner.take_dropped())
        self.encoder_planner.start_step()
        for victim in self.users.over_share(self.running, self._running_in(self.users)):
            self._preempt(victim)
        budget, preempted = self.config.max_num_batched_tokens, False
        for lane in self.lanes:
            budget, lost = self._schedule_running(self._running_in(lane), budget, out)
            preempted |= lost
            if not preempted:
                budget = self._schedule_waiting(lane, budget, out)
        out.free_encoder_ids = self.encoder_cache.get_freed_hashes()
        self.unfinished.add(out)
        return out

    def _schedule_running(self, reqs: list[Request], budget: int, out: SchedulerOutput) -> tuple[int, bool]:
        """Schedule running `reqs` in order within `budget` tokens, preempting (`Lanes.victim`) when KV
        blocks run out; the budget left and whether it preempted a request whose lane is not spare."""
        preempted = False
        for req in reqs:
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING or req.ends_in_flight(self.max_model_len):
                continue  # preempted for a request before it, or its tokens in flight end it
            plan = self.encoder_planner.plan(req, req.num_computed_tokens,
                                             min(req.num_tokens + req.num_in_flight - req.num_computed_tokens, budget))
            if plan.num_tokens == 0:  # its next item cannot run this step
                continue
            while not self.kv_cache.can_allocate(req.request_id, req.num_computed_tokens + plan.num_tokens):
                victim = self.lanes.victim(self.running)
                assert victim.request_id not in out.num_scheduled_tokens, "a victim is never scheduled yet"
                self._preempt(victim)
                preempted |= not self.lanes.of(victim).spare  # spare blocks: admission goes on
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            self._schedule(req, plan, out)
            budget -= plan.num_tokens
        return budget, preempted

    def _schedule_waiting(self, lane: Lane, budget: int, out: SchedulerOutput) -> int:
        """Admit `lane`'s waiting requests in its order while budget, `max_num_seqs` and blocks
        allow (a request that cannot be admitted takes a later spare lane's place); the budget left."""
        while lane.waiting and budget > 0 and lane.may_admit(self.running):
            lane.next_up(self.running)
            if lane.waiting[0].num_in_flight:
                break  # preempted with a token in flight: admitted once it has arrived
            if len(self.running) < self.config.max_num_seqs and self._admit_next(lane, budget, out):
                budget -= out.num_scheduled_tokens.get(self.running[-1].request_id, 0)
            elif (spare := self.lanes.spare_after(lane, self.running)) is not None:
                self._preempt(spare)  # not scheduled yet this step: its lane comes later
            else:
                break
        return budget

    def _admit_next(self, lane: Lane, budget: int, out: SchedulerOutput) -> bool:
        """Admit the first waiting request of `lane` within `budget` tokens (`AdmissionPlanner`):
        scheduled after its prefix-cache hit, or answered with its prompt's cached first token;
        False (and nothing done) when it does not fit."""
        req = lane.waiting[0]
        admission = self.admission.plan(req, lane, budget)
        if admission is None:
            return False
        hit, num_computed = admission.hit, admission.num_computed(req)
        lane.waiting.popleft()
        req.start_running()
        self.running.append(req)
        req.num_computed_tokens = num_computed
        self.admission.record(req, num_computed, lane)
        if admission.plan is not None:
            self._schedule(req, admission.plan, out, hit.blocks)
        else:  # answered: nothing of it is computed this step
            assert admission.token is not None
            self.kv_cache.allocate_slots(req.request_id, num_computed, hit.blocks)
            self.answers.answer(req, admission.token)
            out.new_requests.append(self.runner.new(req))
        out.kv_copies += self.admission.block_copies(req, hit)
        return True

    def _schedule(self, req: Request, plan: EncoderPlan, out: SchedulerOutput,
                  computed: Sequence[KVBlock] = ()) -> None:
        """Give `req` `plan.num_tokens` tokens this step (after the cache hits `computed`, when
        admitted): slots, encoder inputs, and what the runner needs; blocks the step fills join
        the prefix cache."""
        rid, start, n = req.request_id, req.num_computed_tokens, plan.num_tokens
        new_blocks = self.kv_cache.allocate_slots(rid, start + n, computed)
        assert new_blocks is not None, "caller checked can_allocate"
        self.prefix.cache_scheduled(req, start + n)
        self.runner.scheduled(req, new_blocks, start, out)
        self.encoder_planner.commit(req, plan)
        if plan.to_encode:
            out.scheduled_encoder_inputs[rid] = plan.to_encode
        out.num_scheduled_tokens[rid] = n
        if start + n == req.num_tokens + req.num_in_flight:  # reaches its last token: the step samples one
            req.num_in_flight += 1
        req.num_computed_tokens += n
        if self.groups.held:
            released = self.groups.release(req)
            self.requests.update((r.request_id, r) for r in released)
            self.users.queue_released(released)

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self._requeue(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1

    def _requeue(self, req: Request) -> None:
        """Put `req` (out of `running`) back at the head of its lane's queue, to recompute from scratch."""
        self._release(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        self.unfinished.requeued(req.request_id)
        self.lanes.of(req).waiting.appendleft(req)

    def fail_step(self, sched: SchedulerOutput, culprit: str, message: str) -> EngineCoreOutputs:
        """Undo a step that raised in `culprit`'s work: end `culprit` with an internal error
        output (its blocks and items freed) and requeue the step's other requests — scheduled or
        answered (`FirstTokenAnswers.take_back`) — at the head of their queues, to recompute what
        the step lost (the runner drops their state next step)."""
        outputs: list[EngineCoreOutput] = []
        self.unfinished.take(sched, newest=True)  # one before it may still be in flight
        answered = self.answers.take_back()
        step = {rid: sched.num_scheduled_tokens.get(rid, 0) for rid in
                [*sched.num_scheduled_tokens, *(r.request_id for r in answered)]}
        for rid in reversed(list(step)):
            found = self.requests.get(rid)
            if found is None or found.status is not RequestStatus.RUNNING:
                continue
            req = found
            self.running.remove(req)
            if step[rid] and req.num_in_flight:
                req.num_in_flight -= 1  # the failed step's token never comes (one of an earlier step may)
            self.kv_cache.forget_from(rid, req.num_computed_tokens - step[rid])
            if rid == culprit:
                siblings_running = self._finish(req, RequestStatus.FINISHED_ABORTED)
                outputs.append(EngineCoreOutput(req.client_id, [], req.status.finish_reason, error=message,
                                                error_kind="internal", index=req.index,
                                                siblings_running=siblings_running))
                continue
            self._requeue(req)
        return EngineCoreOutputs(outputs)

    # ---- after the step ---------------------------------------------------------------------

    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> EngineCoreOutputs:
        """Append sampled tokens, finish requests that stop, and say what is new per request.

        With --async-scheduling the next step is scheduled already: a request may have finished
        since `sched` (aborted: gone, its token dropped) or been preempted (its token, sampled before
        its blocks were freed, is still its next output)."""
        outputs: list[EngineCoreOutput] = []
        requeued = self.unfinished.take(sched)
        for rid, n in sched.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None:
                continue
            if rid not in requeued:  # where `sched` left it: before the tokens of a step scheduled since
                self.prefix.cache_computed(req, n, req.num_computed_tokens - self.unfinished.pending(rid))
                self.encoder_planner.release_consumed(req)
            if rid in result.prompt_logprobs:
                req.add_prompt_logprobs(*result.prompt_logprobs[rid])
            tokens = result.sampled_token_ids.get(rid)
            if not tokens or not req.num_in_flight:
                continue  # a prefill chunk that did not reach the end of the prompt, or a failed step's
            req.num_in_flight -= 1
            req.append_output_token_ids(tokens)
            hidden = result.hidden.get(rid)  # an embedding request's, with its first token
            self.answers.learn(req, tokens, hidden)
            outputs.append(self._output(req, tokens, result.logprobs.get(rid), result.first_logits.get(rid), hidden))
        return EngineCoreOutputs(outputs + self.drain_answered())

    def drain_answered(self) -> list[EngineCoreOutput]:
        """The outputs of the requests answered with a cached first token since the last update
        (`update_from_output` sends them; --async-scheduling, after a step with none in flight, too)."""
        return [self._output(req, req.output_token_ids[-1:], hidden=req.answered_hidden) for req in self.answers.drain()
                if req.status is RequestStatus.RUNNING]

    def _output(self, req: Request, tokens: list[int], logprobs: list[TokenLogprobs] | None = None,
                first_logits: bytes | None = None, hidden: bytes | None = None) -> EngineCoreOutput:
        """What is new for `req`, its `tokens` appended already: finished if it stops (`Request.output`)."""
        status = req.stop_status(self.max_model_len)
        siblings_running = False
        if status is not None:
            self._unqueue(req)
            siblings_running = self._finish(req, status)
        return req.output(tokens, siblings_running, logprobs, first_logits, hidden)

    def _finish(self, req: Request, status: RequestStatus) -> bool:
        """End `req`; whether other completions of its request still run."""
        req.status = status
        self._release(req)
        del self.requests[req.request_id]
        return self.groups.finish(req)

    def _release(self, req: Request) -> None:
        """Free the request's blocks and encoder references; the runner drops its state next step."""
        self.kv_cache.free(req.request_id)
        self.encoder_cache.free(req)
        self.runner.drop(req.request_id)

    def check_integrity(self) -> None:
        """Between steps: queues, block ownership and encoder references agree — every owner of
        blocks or encoder outputs is running, and references only outputs it still needs."""
        self.kv_cache.check_integrity()
        self.encoder_cache.check_integrity()
        self.groups.check_integrity()
        self.answers.check_integrity()
        self.lanes.check_integrity(self.running)
        waiting = [r for lane in self.lanes for r in lane.waiting]
        running = {r.request_id for r in self.running}
        assert set(self.kv_cache.req_to_blocks) <= running, "a non-running request owns blocks"
        assert not any(self.encoder_cache.held_items(r.request_id) for r in waiting), "a waiting request holds one"
        assert running | {r.request_id for r in waiting} == set(self.requests)
        assert len(self.running) <= self.config.max_num_seqs
        for req in self.running:
            blocks = len(self.kv_cache.req_to_blocks.get(req.request_id, ()))
            assert blocks >= self.kv_cache.blocks_needed(req.num_computed_tokens), f"{req} lacks KV blocks"
            # a step not yet updated from (in flight) releases what it consumes when it is
            updated = req.num_computed_tokens - self.unfinished.pending(req.request_id)
            for idx in self.encoder_cache.held_items(req.request_id):
                assert req.mm_items[idx].placeholder.end > updated, f"{req} kept a consumed output"
