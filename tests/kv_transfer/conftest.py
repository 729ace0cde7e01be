"""Fixtures of the KV connector tests: a model whose sliding-window group may travel but must never be stored."""
from __future__ import annotations

import pytest

from surge.core.kv_cache.spec import SlidingWindowSpec
from tiny_models import make_tiny_model


class ScratchSlidingWindowSpec(SlidingWindowSpec):
    """A group that may travel between instances but must never be stored as prefix data (vLLM #55027)."""

    @property
    def prefix_cacheable(self) -> bool:
        return False


@pytest.fixture
def scratch_group_model(tmp_path, monkeypatch):
    """A tiny hybrid Qwen3 whose engine (in this process) builds its sliding-window group as a scratch group:
    transferable, not prefix-cacheable."""
    import surge.worker.model_runner as model_runner
    from surge.core.kv_cache import spec as spec_module

    built = spec_module.build_kv_cache_groups

    def with_scratch(*args, **kwargs):
        def scratch(g):
            if not isinstance(g.spec, SlidingWindowSpec):
                return g
            spec = ScratchSlidingWindowSpec(g.spec.block_size, g.spec.num_kv_heads, g.spec.head_dim, g.spec.dtype,
                                            sliding_window=g.spec.sliding_window)
            return spec_module.KVCacheGroup(g.group_id, spec, g.layer_ids)
        return tuple(scratch(g) for g in built(*args, **kwargs))

    monkeypatch.setattr(model_runner, "build_kv_cache_groups", with_scratch)
    return make_tiny_model("qwen3-hybrid", tmp_path / "scratch-hybrid")
