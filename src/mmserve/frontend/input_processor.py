"""P0's input processing: prompt (+ images) -> an `EngineCoreRequest`.

Everything a user can get wrong is checked here, before the engine core sees the request:
the prompt's shape, the number and kind of images, the prompt's length. Images are resolved
through the processor cache (`multimodal/items.py`); a request that fails leaves no entry.
"""

from __future__ import annotations

import time
from typing import Any, Callable, cast

import msgspec

from mmserve.errors import ClientError
from mmserve.cache_report import CacheReport
from mmserve.config import EngineConfig, compute_encoder_budget
from mmserve.frontend.request.bad_words import bad_word_sequences
from mmserve.frontend.request.prompt import Prompt
from mmserve.frontend.request.truncation import kept_tokens, truncate
from mmserve.frontend.video_input import VideoInputs
from mmserve.ipc.messages import EngineCoreRequest
from mmserve.models.generation_config import announce, load_generation_defaults
from mmserve.models.hf_config import load_model_config
from mmserve.multimodal.processor_cache import ProcessorCache
from mmserve.ipc.items import MultiModalItem, PlaceholderRange
from mmserve.multimodal.budget import ItemBudget
from mmserve.multimodal.image_items import ItemResolver
from mmserve.multimodal.items import ResolvedItem
from mmserve.multimodal.placeholders import max_token_chars, tokens_past
from mmserve.multimodal.processing import create_processor
from mmserve.multimodal.processor_api import ItemProcessor
from mmserve.sampling_params import SamplingParams
from mmserve.structured_outputs import check_structure


class InputProcessor:
    def __init__(self, config: EngineConfig, model_dir: str, max_model_len: int, eos_token_id: int | None,
                 known_tokens: Callable[[str], int | None] = lambda h: None,
                 fetch: Callable[[str], dict[str, Any] | None] = lambda h: None,
                 processor: ItemProcessor | None = None) -> None:
        """`processor`: the checkpoint's (`create_processor(model_dir)`, made here when not given)."""
        self.config = config
        self.processor: ItemProcessor = create_processor(model_dir) if processor is None else processor
        self.tokenizer = self.processor.tokenizer
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.generation = load_generation_defaults(model_dir, config.model.generation_config,
                                                   config.model.override_generation_config)
        if config.parallel.api_server_count == 1:  # with several, the launcher says it (launcher.py)
            announce(self.generation)
        mm = config.multimodal
        self.media_limits = mm.media_limits()
        self.processor_cache = ProcessorCache(config.processor_cache_bytes_per_server)
        model_config = load_model_config(model_dir)
        # the model's largest item at default settings sizes the engine's encoder budgets; a
        # request's own processor settings may make a larger item, refused before it is processed
        self.max_encoder_tokens = _encoder_limit(config, model_config.max_item_tokens)
        budget = ItemBudget(self.max_encoder_tokens, max_model_len - 1)
        self.items = ItemResolver(config.model.model, self.processor, self.processor_cache, self.media_limits,
                                  config.needs_item_hash, known_tokens, fetch, budget)
        self.videos = VideoInputs(config, self.processor, self.processor_cache, self.items.hasher, budget,
                                  self.items.inflight)
        self.mm_defaults = self._server_image_kwargs(config)
        self.vocab_size = model_config.text.vocab_size
        self.max_prompt_chars = max_model_len * max_token_chars(self.tokenizer)

    def _server_image_kwargs(self, config: EngineConfig) -> dict[str, Any]:
        """`--mm-processor-kwargs`' image keys, which each request's own override key by key: what
        the model's processor takes, checked now (the video keys, by `VideoInputs`)."""
        mm = config.multimodal
        try:
            self.items.modality.settings(mm.mm_processor_kwargs)  # the processor's check, the server's pixel limit
        except ClientError as e:
            raise ValueError(f"--mm-processor-kwargs: {e}") from None
        return mm.image_processor_kwargs

    def process(self, request_id: str, prompt: str | dict[str, Any] | Prompt, params: SamplingParams,
                pending: list[ResolvedItem] | None = None, bypass_caches: bool = False,
                report: CacheReport | None = None, priority: int = 0) -> EngineCoreRequest:
        """The request for the engine, or a ValueError (and then nothing of it stays).

        Given a `pending` list the freshly processed items go there and stay out of the processor
        cache (and in flight) until the caller says `accept(pending)` once the engine has the
        request, or `reject(pending)` when a later step failed: a request that fails anywhere leaves
        no entry (the list is its owner's: `open_request.py: OpenRequest.pending`).
        `bypass_caches` (a shadow run) processes every item from its source and marks the request
        so that no later cache serves it either; `report` gets the processor cache's lookups.
        `priority` (vLLM's) orders it under `--scheduling-policy priority`; refused under fcfs."""
        self._check_priority(priority)
        params = self._check_params(params)
        prompt = Prompt.parse(prompt)
        keep = kept_tokens(params.truncate_prompt_tokens, self.max_model_len)
        if prompt.token_ids is not None:
            return self._tokens_request(request_id, prompt, params, bypass_caches, priority, keep)
        text, images, salt = prompt.text, prompt.images, prompt.settings.cache_salt
        mm_kwargs = {**self.mm_defaults, **(prompt.settings.mm_processor_kwargs or {})}  # the request's win
        if keep is None:  # a truncated prompt may be longer than the context: it is cut once tokenized
            self.check_prompt_length(text)
        limit = self.config.multimodal.max_images
        if len(images) > limit:
            raise ClientError(f"the prompt has {len(images)} images, more than the limit of {limit} "
                             f"(--limit-mm-per-prompt)")
        self.processor.check_image_count(text, len(images))
        resolved = self.items.resolve(images, prompt.image_uuids, salt, mm_kwargs, bypass_caches)
        videos: list[ResolvedItem] = []
        try:
            videos = self.videos.resolve(prompt, bypass_caches)  # [] without videos
            token_ids, ranges, groups = self._placed(prompt, resolved, videos, keep)
        except BaseException:
            self.items.release(resolved + videos)  # one in-flight table for every modality
            raise
        resolved += videos
        if pending is None:
            self.items.commit(resolved)
        else:
            pending += resolved
        position_key = self.processor.position_key
        items = [MultiModalItem("image", r.mm_hash, r.data, rng, position_key=position_key(cast(dict, r.data)))
                 for r, rng in zip(resolved, ranges)]
        items = sorted(items + groups, key=lambda item: item.placeholder.offset)  # prompt order
        if report is not None:
            _report_items(report, resolved, items)
        params = self.generation.with_eos_stops(params, self.tokenizer.eos_token_id)
        return EngineCoreRequest(request_id, token_ids, items, params, self.eos_token_id, time.time(),
                                 cache_salt=salt, bypass_caches=bypass_caches, priority=priority)

    def _placed(self, prompt: Prompt, resolved: list[ResolvedItem], videos: list[ResolvedItem],
                keep: int | None) -> tuple[list[int], list[PlaceholderRange], list[MultiModalItem]]:
        """The prompt's token ids with its items' placeholders expanded (each item within the
        encoder budget), its last `keep` tokens where it is truncated, room left for one output
        token; the images' ranges and the videos' groups."""
        self._check_item_sizes(resolved)
        self.videos.check_sizes(videos, self.max_encoder_tokens)
        token_ids, ranges, groups = self.videos.expand(prompt.text, [r.num_tokens for r in resolved], videos)
        token_ids = self._continued(token_ids, prompt.continuation)
        if keep is not None:
            token_ids, ranges, groups = truncate(token_ids, ranges, groups, keep)
        if len(token_ids) >= self.max_model_len:
            raise ClientError(f"the prompt has {len(token_ids)} tokens (images included), but max_model_len "
                              f"is {self.max_model_len}, which must also leave room for one output token")
        return token_ids, ranges, groups

    def _tokens_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                        bypass_caches: bool, priority: int, keep: int | None) -> EngineCoreRequest:
        """A prompt of token ids: each within the vocabulary, and room for one output token (its
        last `keep` tokens where the request truncates it)."""
        token_ids = self._continued(list(prompt.token_ids or ()), prompt.continuation)
        if keep is not None:
            token_ids = token_ids[-keep:]
        bad = [t for t in token_ids if t >= self.vocab_size]
        if bad:
            raise ClientError(f"prompt token ids {bad[:3]} are not token ids of this model (vocabulary of "
                              f"{self.vocab_size})")
        if len(token_ids) >= self.max_model_len:
            raise ClientError(f"the prompt has {len(token_ids)} tokens, but max_model_len is {self.max_model_len}, "
                              f"which must also leave room for one output token")
        params = self.generation.with_eos_stops(params, self.tokenizer.eos_token_id)
        return EngineCoreRequest(request_id, token_ids, [], params, self.eos_token_id, time.time(),
                                 cache_salt=prompt.settings.cache_salt, bypass_caches=bypass_caches,
                                 priority=priority)

    def accept(self, pending: list[ResolvedItem]) -> None:
        """The engine has the request: its fresh items join the processor cache."""
        resolved, pending[:] = list(pending), []
        self.items.commit(resolved)

    def reject(self, pending: list[ResolvedItem]) -> None:
        """A step after `process` failed: end the request's in-flight items, keep nothing."""
        resolved, pending[:] = list(pending), []
        self.items.release(resolved)

    def check_prompt_length(self, text: str) -> None:
        """ValueError, before the whole text is tokenized, when it cannot fit max_model_len: more
        characters than max_model_len tokens can spell (no token spells more than the tokenizer's
        longest piece) is refused unread; a long text whose prefix alone has too many tokens is
        refused once that prefix is tokenized. Tokenizing is bounded by the limit, not by the input."""
        if len(text) > self.max_prompt_chars:
            raise ClientError(f"the prompt has {len(text)} characters, more than max_model_len ({self.max_model_len}) "
                             f"tokens can hold ({self.max_prompt_chars} characters at most); it was not tokenized")
        past = tokens_past(self.processor.tokenizer, text, self.max_model_len)
        if past is not None:
            raise ClientError(f"the prompt has more than {past[0]} tokens (its first {past[1]} characters were "
                             f"tokenized), but max_model_len is {self.max_model_len}")

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends a generation: the engine's EOS, the generation config's, the tokenizer's."""
        ids = {self.eos_token_id, *self.generation.eos_token_ids, self.tokenizer.eos_token_id}
        return frozenset(i for i in ids if i is not None)

    def _continued(self, token_ids: list[int], continuation: tuple[int, ...]) -> list[int]:
        """The prompt's tokens and then `continuation`'s (each within the vocabulary)."""
        bad = [t for t in continuation if t >= self.vocab_size]
        if bad:
            raise ClientError(f"token ids {bad[:3]} are not token ids of this model (vocabulary of {self.vocab_size})")
        return token_ids + list(continuation) if continuation else token_ids

    def _check_priority(self, priority: int) -> None:
        """A priority other than 0 needs `--scheduling-policy priority` (vLLM refuses it too)."""
        if isinstance(priority, bool) or not isinstance(priority, int) or not -2**63 <= priority < 2**63:
            raise ClientError(f"priority must be a 64-bit integer; got {priority!r}", param="priority")
        if priority and self.config.scheduler.scheduling_policy != "priority":
            raise ClientError(f"priority {priority} needs priority scheduling, which this server does not run "
                              "(--scheduling-policy priority)", param="priority")

    def _check_params(self, params: SamplingParams) -> SamplingParams:
        """Ranges only the model knows: token ids within its vocabulary, max_tokens within its length;
        a structured-output schema the grammar can be built from. `params` with its `bad_words`
        tokenized (`bad_words_token_ids`) and its `allowed_token_ids` without repeats."""
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ClientError(f"stop_token_ids {bad[:3]} are not token ids of this model (vocabulary of "
                             f"{self.vocab_size})")
        if params.max_tokens > self.max_model_len:
            raise ClientError(f"max_tokens ({params.max_tokens}) exceeds this model's context length "
                             f"(max_model_len {self.max_model_len})")
        bad = [t for t in params.logit_bias or () if t >= self.vocab_size]
        if bad:
            raise ClientError(f"logit_bias keys {bad[:3]} are not token ids of this model (vocabulary of "
                             f"{self.vocab_size})")
        allowed = params.allowed_token_ids
        if allowed is not None:
            bad = [t for t in allowed if t >= self.vocab_size]
            if bad:
                raise ClientError(f"allowed_token_ids {bad[:3]} are not token ids of this model (vocabulary of "
                                  f"{self.vocab_size})")
            if len(unique := sorted(set(allowed))) < len(allowed):  # at most the vocabulary reaches P1's sampler
                params = msgspec.structs.replace(params, allowed_token_ids=unique)
        if params.structured_outputs is not None:
            check_structure(params.structured_outputs)
        if params.bad_words and params.bad_words_token_ids is None:
            try:
                sequences = bad_word_sequences(self.tokenizer, params.bad_words, self.vocab_size)
            except ValueError as exc:
                raise ClientError(str(exc)) from None
            params = msgspec.structs.replace(params, bad_words_token_ids=sequences)
        return params

    def _check_item_sizes(self, resolved: list[ResolvedItem]) -> None:
        """A ValueError for an item larger than the engine's encoder budget (it could never run)."""
        limit = self.max_encoder_tokens
        for index, item in enumerate(resolved):
            if item.num_tokens > limit:
                raise ClientError(f"image {index} needs {item.num_tokens} embedding tokens, more than the encoder "
                                 f"cache and budget hold ({limit}); send a smaller image or lower max_pixels")


def _report_items(report: CacheReport, resolved: list[ResolvedItem], items: list[MultiModalItem]) -> None:
    """The processor cache's lookups for this request, and its items' hashes."""
    looked_up = [r.hit for r in resolved if r.hit is not None]
    if looked_up:
        report.count("processor", sum(looked_up), len(looked_up))
    report.item_hashes = [item.mm_hash for item in items]


def _encoder_limit(config: EngineConfig, max_item_tokens: int) -> int:
    """The most embedding tokens one item may have: the encoder budget and cache (and with
    --disable-chunked-mm-input, one step's tokens), as the engine's scheduler sizes them."""
    compute, cache_size = compute_encoder_budget(config.scheduler, max_item_tokens)
    limit = min(compute, cache_size)
    if config.scheduler.disable_chunked_mm_input:
        limit = min(limit, config.scheduler.max_num_batched_tokens)
    return limit
