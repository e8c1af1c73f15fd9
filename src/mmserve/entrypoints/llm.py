"""The offline API: `LLM(model=..., **engine_args).generate(prompts, sampling_params)`."""

from __future__ import annotations

import functools
import itertools
import weakref
from types import TracebackType
from typing import Any, Callable, Sequence, cast

from mmserve import beam_search
from mmserve.beam_search import BeamSearch, BeamSearchOutput
from mmserve.config import EngineConfig
from mmserve.frontend.request.chat import check_tools, parse_chat_messages
from mmserve.frontend.engine_client.llm_engine import LLMEngine
from mmserve.frontend.request.prompt import Prompt
from mmserve.models.hub import resolve_engine_model
from mmserve.multimodal.chat_templates import ChatTemplatePolicy, load_chat_template
from mmserve.frontend.output.embedding import embedding_output
from mmserve.outputs import EmbeddingRequestOutput, RequestOutput
from mmserve.pooling_params import PoolingParams
from mmserve.sampling_params import BeamSearchParams, SamplingParams

PromptType = str | dict[str, Any] | Prompt  # a string, vLLM's dict form, or a `Prompt`


class LLM:
    """A VLM served in this process. Engine arguments are the CLI flags' snake_case names.

    Unlike the server, the offline API reads image files anywhere by default (its caller
    already has the machine's files); pass `allowed_local_media_path` to narrow that.

    Its memory (weights, KV cache, CUDA graphs, worker and engine processes) is given back by
    `shutdown()`, at the end of a `with LLM(...) as llm:` block (an exception leaving the block
    included), or when the object is collected; after shutdown every call raises RuntimeError.
    """

    def __init__(self, model: str = "builtin:tiny-llava", **engine_args: Any) -> None:
        """`model`: a Hugging Face repo id (downloaded here, once, or found in the cache; `revision`,
        `tokenizer_revision`, `download_dir`), a checkpoint directory or a builtin name."""
        engine_args.setdefault("allowed_local_media_path", "/")
        config = EngineConfig.from_kwargs(model=model, **engine_args)
        if config.parallel.api_server_count != 1:
            raise ValueError("api_server_count is a flag of mmserve serve; LLM has no API server")
        self._engine: LLMEngine | None = LLMEngine(resolve_engine_model(config))
        # stops the engine when this object is collected (or at exit); it holds the engine, not the LLM
        self._finalizer = weakref.finalize(self, LLMEngine.shutdown, self._engine)
        self._ids = itertools.count()

    @property
    def engine(self) -> LLMEngine:
        """The offline engine; RuntimeError once `shutdown` has run."""
        if self._engine is None:
            raise RuntimeError("this LLM was shut down: its engine and memory are released; make a new LLM")
        return self._engine

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no parameters: the checkpoint's generation config
        (`--generation-config`, as vLLM's `LLM.get_default_sampling_params`), else `SamplingParams()`."""
        inputs = self.engine.input_processor
        values = dict(inputs.generation.request_defaults)
        if "max_tokens" in inputs.generation.sampling:  # never above the model's length
            values["max_tokens"] = inputs.generation.max_tokens(inputs.max_model_len)
        return SamplingParams(**values)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run all prompts together; outputs come back in the prompts' order.

        `priority` (vLLM's): one per prompt, with `scheduling_policy="priority"`; the lower, the
        sooner a prompt runs (a ValueError under "fcfs" unless every one is 0).

        Every prompt is checked before any is sent: one bad prompt raises ValueError and none run.
        A request the engine fails alone finishes with finish_reason "abort"; an engine core that
        fails as a whole raises, and every prompt of the call is aborted. One rank or N alike.
        """
        if self.engine.config.model.pools:
            raise ValueError("LLM.generate is for generative models; this one runs with runner='pooling' "
                             "(LLM.embed)")
        if isinstance(prompts, (str, dict, Prompt)):
            prompts = [prompts]
        params = _broadcast_params(sampling_params, len(prompts), self.get_default_sampling_params)
        ids = [str(next(self._ids)) for _ in prompts]
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} values for {len(prompts)} prompts")
        self.engine.add_requests(ids, prompts, params, priority)
        try:
            return self._run(ids)
        except BaseException:
            self.engine.abort_requests(ids)
            raise

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's `LLM.embed` (with `runner="pooling"`): each prompt's embedding, the final-normed
        hidden state of its last token (LAST pooling), L2-normalized unless `pooling_params` or
        `pooler_config` say not; images as `generate` takes them, through the same caches. Every
        prompt is checked before any runs (ValueError: none run); outputs in the prompts' order."""
        config = self.engine.config.model
        if not config.pools:
            raise ValueError("LLM.embed is for pooling models: make the LLM with runner='pooling'")
        pooling = pooling_params or PoolingParams()
        if isinstance(prompts, (str, dict, Prompt)):
            prompts = [prompts]
        truncate = truncate_prompt_tokens if truncate_prompt_tokens is not None else pooling.truncate_prompt_tokens
        params = SamplingParams(max_tokens=1, temperature=0.0, truncate_prompt_tokens=truncate)
        ids = [str(next(self._ids)) for _ in prompts]
        self.engine.add_requests(ids, prompts, [params] * len(ids), embed=True)
        try:
            finished = self._run(ids)
        except BaseException:
            self.engine.abort_requests(ids)
            raise
        normalize = config.pooling_normalize if pooling.normalize is None else pooling.normalize
        return [embedding_output(out, normalize) for out in finished]

    def beam_search(self, prompts: PromptType | Sequence[PromptType],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: each prompt's `params.beam_width` best beams (`beam_search.py`),
        in the prompts' order; each round runs every prompt's live beams as one batch."""
        if isinstance(prompts, (str, dict, Prompt)):
            prompts = [prompts]
        inputs = self.engine.input_processor
        searches = [BeamSearch(Prompt.parse(p), params, inputs.eos_token_ids, max_model_len=inputs.max_model_len)
                    for p in prompts]
        beam_search.run(searches, lambda step: self.generate(step, params.step_params()))
        decode = functools.partial(inputs.tokenizer.decode, skip_special_tokens=True)
        return [beam_search.sequences_of(s, decode) for s in searches]

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             tools: list[dict[str, Any]] | None = None, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None,
             chat_template_content_format: str = "auto") -> list[RequestOutput]:
        """OpenAI-style messages (or a list of conversations) through the model's chat template, or
        `chat_template` (a Jinja template or a file holding one); `tools` (OpenAI function tools)
        are rendered by the template as it defines. `add_generation_prompt` ends the prompt with the
        reply's header; `continue_final_message` (with add_generation_prompt False) ends it inside
        the last message, which the model continues; `chat_template_kwargs` are template variables;
        `chat_template_content_format` "openai" / "string" / "auto" says whether the template gets a
        message's content parts or one string (vLLM's `LLM.chat`). Every conversation renders before
        any runs (ValueError: none run)."""
        tools = check_tools(tools) if tools is not None else None
        template = load_chat_template(chat_template) if chat_template is not None else None
        options = ChatTemplatePolicy(trust_request_templates=True, content_format=chat_template_content_format).options(
            template, chat_template_kwargs, add_generation_prompt, continue_final_message)
        render = self.engine.input_processor.processor.apply_chat_template
        conversations = cast(list[list[dict[str, Any]]],
                             messages if messages and isinstance(messages[0], list) else [messages])
        prompts = []
        for conversation in conversations:
            inputs = parse_chat_messages(conversation)
            prompts.append(inputs.prompt(render(inputs.conversation, tools, options)).to_dict())  # LLMEngine's form
        return self.generate(prompts, sampling_params)

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every computed prompt prefix (vLLM's; `frontend/cache_resets.py`): the next
        requests compute theirs again. Always True: running requests keep their blocks, so there
        is nothing to preempt (`reset_running_requests`), and there is no KV connector."""
        self.engine.reset_caches(prefix=True)
        return True

    def reset_mm_cache(self) -> None:
        """Forget every processed image and video (vLLM's): the processor runs again on the next."""
        self.engine.reset_caches(mm=True)

    def reset_encoder_cache(self) -> None:
        """Forget every vision tower output (vLLM's): the tower runs again on the next item."""
        self.engine.reset_caches(encoder=True)

    def shutdown(self) -> None:
        """Stop the engine and release its memory: weights, KV cache and CUDA graphs (torch's cached
        GPU memory emptied), worker and engine processes with tensor or data parallelism. The LLM
        is unusable after; a second call does nothing."""
        self._engine = None
        self._finalizer()  # runs LLMEngine.shutdown once, then drops its reference to the engine

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
        return [finished[rid] for rid in ids]


def _broadcast_params(params: SamplingParams | Sequence[SamplingParams] | None, n: int,
                      default: Callable[[], SamplingParams]) -> list[SamplingParams]:
    if params is None:
        return [default()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if isinstance(params, dict):
        return [SamplingParams.from_dict(params)] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return list(params)
