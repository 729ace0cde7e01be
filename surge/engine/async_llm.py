"""AsyncLLM: the asyncio front end of an EngineCore running in its own process (engine/core_proc.py).

It tokenizes, fans out n > 1, and sends requests over ZMQ; one output-handler task receives token ids,
detokenizes, and feeds a queue per request. `generate()` streams RequestOutputs; cancelling it aborts the request.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable

import msgspec

from surge.config import EngineConfig
from surge.engine.args import EngineArgs
from surge.engine.core import SchedulerStats
from surge.engine.core_proc import CoreClient, EngineDeadError
from surge.engine.input_processor import InputProcessor, Prompt, load_tokenizer
from surge.engine.messages import AbortRequests, AddRequest, EngineCoreOutputs, StopRequests, UtilityCall
from surge.engine.output_processor import IterationStats, OutputKind, OutputProcessor
from surge.logger import init_logger
from surge.lora.checker import AdapterChecker
from surge.lora_request import LoRARequest
from surge.engine.pooling import PROMPT_ONLY
from surge.outputs import PoolingRequestOutput, RequestOutput
from surge.pooling_params import PoolingParams
from surge.sampling_params import SamplingParams

logger = init_logger(__name__)

# Called after each batch of engine outputs: the core's load and what this batch did (see metrics).
StatsObserver = Callable[[SchedulerStats | None, IterationStats], None]


class RequestFailedError(RuntimeError):
    """The engine refused or failed one request. invalid_request: the request's fault (a 4xx), else the engine's."""

    def __init__(self, message: str, invalid_request: bool) -> None:
        super().__init__(message)
        self.invalid_request = invalid_request


class AsyncLLM:
    def __init__(self, config: EngineConfig, stats_observers: list[StatsObserver] | None = None,
                 startup_timeout: float = 900.0) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.model_config.model)
        self.input_processor = InputProcessor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.adapters = AdapterChecker(config)
        self.stats_observers = list(stats_observers or [])
        self.core = CoreClient(config, startup_timeout)
        self.last_stats: SchedulerStats | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._utility_futures: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._request_ids = itertools.count()
        self._output_task: asyncio.Task | None = None

    @classmethod
    def from_engine_args(cls, model=None, stats_observers: list[StatsObserver] | None = None,
                         **engine_kwargs) -> AsyncLLM:
        """engine_kwargs: EngineArgs's fields (surge/engine/args.py)."""
        return cls(EngineArgs(model, **engine_kwargs).create_engine_config(), stats_observers)

    # ---- health ----
    @property
    def dead_error(self) -> EngineDeadError | None:
        return self.core.dead_error

    @property
    def is_running(self) -> bool:
        return self.core.dead_error is None and self.core.proc.is_alive()

    # ---- requests ----
    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                       output_kind: OutputKind = OutputKind.DELTA, pooling_params: PoolingParams | None = None,
                       lora_request: LoRARequest | None = None
                       ) -> AsyncIterator[RequestOutput | PoolingRequestOutput]:
        """Stream a request's outputs until it finishes. Closing or cancelling the iterator aborts the request
        (its KV blocks are freed). Raises RequestFailedError or EngineDeadError when the engine cannot finish it.
        With pooling_params (a pooling model; params are then ignored): one PoolingRequestOutput."""
        request_id = request_id or f"req-{next(self._request_ids)}"
        queue = await self.add_request(request_id, prompt, params, output_kind, pooling_params, lora_request)
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                await self.abort(request_id)

    async def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                          output_kind: OutputKind = OutputKind.DELTA,
                          pooling_params: PoolingParams | None = None,
                          lora_request: LoRARequest | None = None) -> asyncio.Queue:
        """lora_request: the adapter the request runs with (checked here: a bad one is a ValueError)."""
        if self.core.dead_error is not None:
            raise self.core.dead_error
        if lora_request is not None:
            self.adapters.check(lora_request)
        self._start_output_handler()
        arrival = time.monotonic()
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            # The HF processor takes long on a large image: a worker thread runs it, the event loop serves on.
            text, token_ids, mm_features = await asyncio.to_thread(self.input_processor.process, prompt)
        else:
            text, token_ids, mm_features = self.input_processor.process(prompt)
        if request_id in self._queues:  # checked after the await, right before the id is taken
            raise ValueError(f"request_id={request_id!r} is already in use")
        pooling = pooling_params is not None
        children = [(request_id, PROMPT_ONLY)] if pooling else self.input_processor.fan_out(request_id, params)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self.output_processor.add_request(request_id, text, token_ids, children, output_kind, arrival, pooling)
        try:
            for child_id, child_params in children:
                await self.core.send(AddRequest(child_id, token_ids, child_params, pooling_params, lora_request,
                                                mm_features))
        except BaseException:
            await self.abort(request_id)
            raise
        return queue

    async def abort(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        child_ids = self.output_processor.abort(request_id)
        if child_ids and self.core.dead_error is None:
            await self.core.send(AbortRequests(child_ids))

    # ---- utilities ----
    async def call_utility(self, method: str, *args, timeout: float = 60.0):
        if self.core.dead_error is not None:
            raise self.core.dead_error
        self._start_output_handler()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._utility_futures[call_id] = future
        try:
            await self.core.send(UtilityCall(call_id, method, list(args)))
            return await asyncio.wait_for(future, timeout)
        finally:
            self._utility_futures.pop(call_id, None)

    async def get_stats(self) -> SchedulerStats:
        return msgspec.convert(await self.call_utility("get_stats"), SchedulerStats)

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.call_utility("reset_prefix_cache"))

    async def remove_lora(self, lora_int_id: int) -> bool:
        """The adapter was unloaded: the workers free its slot (EngineCore.remove_lora)."""
        return bool(await self.call_utility("remove_lora", lora_int_id))

    # ---- output handling ----
    def _start_output_handler(self) -> None:
        """Start (or, under a new event loop, restart) the one task that reads the core's outputs."""
        loop = asyncio.get_running_loop()
        if self._output_task is not None and not self._output_task.done() and self._output_task.get_loop() is loop:
            return
        self.core.watch(self._on_core_death)
        self._output_task = loop.create_task(self._handle_outputs(), name="surge-output-handler")

    async def _handle_outputs(self) -> None:
        try:
            while True:
                batch = await self.core.recv()
                await self._process(batch)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here would hang every request: fail them loudly instead
            logger.exception("the output handler failed")
            self._fail_everything(EngineDeadError(f"the output handler failed: {type(e).__name__}: {e}"))

    async def _process(self, batch: EngineCoreOutputs) -> None:
        stats = IterationStats()
        outputs, to_stop = self.output_processor.process(batch.outputs, stats)
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        for failure in batch.failures:
            failed = self.output_processor.fail(failure.request_id)
            if failed is None:
                continue
            parent_id, siblings = failed
            queue = self._queues.pop(parent_id, None)
            if queue is not None:
                queue.put_nowait(RequestFailedError(failure.message, failure.invalid_request))
            if siblings:
                await self.core.send(AbortRequests(siblings))
        for result in batch.utility_results:
            future = self._utility_futures.get(result.call_id)
            if future is not None and not future.done():
                if result.error is not None:
                    future.set_exception(RuntimeError(result.error))
                else:
                    future.set_result(result.result)
        if to_stop:
            await self.core.send(StopRequests(to_stop))
        if batch.stats is not None:
            self.last_stats = batch.stats
        for observer in self.stats_observers:
            observer(batch.stats, stats)

    def _fail_everything(self, error: BaseException) -> None:
        for request_id, queue in list(self._queues.items()):
            queue.put_nowait(error)
            self.output_processor.abort(request_id)
        self._queues.clear()
        for future in self._utility_futures.values():
            if not future.done():
                future.set_exception(error)

    def _on_core_death(self, error: EngineDeadError) -> None:
        self._fail_everything(error)
        if self._output_task is not None:
            self._output_task.cancel()

    # ---- shutdown ----
    async def shutdown(self) -> None:
        if self._output_task is not None:
            self._output_task.cancel()
            try:
                await self._output_task
            except (asyncio.CancelledError, Exception):
                pass
        self.core.shutdown()
