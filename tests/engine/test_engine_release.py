"""A shut-down engine's memory comes back: start-up freezes its objects out of the collector's view (gc.freeze),
and shutdown must hand them back, or a reference cycle through the engine keeps its model and KV cache for good."""
from __future__ import annotations

import gc
import weakref

from surge import SamplingParams
from surge.core.request import Request
from surge.engine.args import EngineArgs
from surge.engine.core import EngineCore


def test_shutdown_releases_the_model_and_kv_cache():
    engine = EngineCore(EngineArgs(preset="tiny-llama", load_format="dummy", device="cpu", max_model_len=256,
                                   kv_cache_memory=1 << 22).create_engine_config())
    runner = engine.executor.runner
    model, cache = weakref.ref(runner.model), weakref.ref(runner.kv_caches[0])
    runner.cycle = runner  # a cycle through the engine's objects, as real ones (closures, back references) make
    assert gc.isenabled()
    engine.shutdown()
    del engine, runner
    gc.collect()
    assert model() is None and cache() is None


def test_startup_objects_are_frozen_after_the_first_output_and_released_at_shutdown():
    """The freeze waits for the first output (its collection would delay a restart's first token), comes at the
    next step, and shutdown still releases the engine."""
    gc.unfreeze()
    engine = EngineCore(EngineArgs(preset="tiny-llama", load_format="dummy", device="cpu", max_model_len=256,
                                   kv_cache_memory=1 << 22).create_engine_config())
    runner = engine.executor.runner
    model = weakref.ref(runner.model)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request(Request("0", list(range(1, 20)), params, engine.config.cache_config.block_size))
    outputs = []
    while not outputs:
        assert gc.get_freeze_count() == 0
        outputs = engine.step()
    assert gc.get_freeze_count() == 0  # the first token went out before any collection
    engine.step()
    assert gc.get_freeze_count() > 0
    engine.shutdown()
    assert gc.get_freeze_count() == 0
    del engine, runner
    gc.collect()
    assert model() is None
