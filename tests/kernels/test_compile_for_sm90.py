"""Kernels compile for the GPU, not only run in the interpreter. Triton's compiler (its AST code generator) rejects
constructs the interpreter runs: an annotated constexpr (`x: tl.constexpr = ...`) inside a static_range body was
"already defined" at the loop's second unrolled step on the H200 (indexer_topk._select). Triton compiles to sm_90
cubin without a GPU (its wheel carries ptxas), so each launch here is compiled for it instead of run, in a
subprocess: the test process runs with TRITON_INTERPRET=1, under which the kernels are interpreted, not compiled.
The kernels' own wrappers make the launches (on CPU tensors, whose contents nothing reads), with the specialization
a launch gets (16-divisible pointers and integers, integers of 1)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

# Every JITFunction launch (kernel[grid](...) and kernel.warmup(...)) compiles for sm_90 and returns: Triton's own
# run() with warmup=True, under a stand-in for the CUDA driver that only names the target.
HARNESS = """
import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction


class CompileOnlyDriver:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


driver.set_active(CompileOnlyDriver())
compiled = []
_run = JITFunction.run


def compile_only(self, *args, grid, warmup, **kwargs):
    kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    compiled.append(self.__name__)
    return kernel


JITFunction.run = compile_only
"""


def _compile_in_subprocess(script: str) -> list[str]:
    """Runs HARNESS then script; returns the names of the kernels compiled, in order."""
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton has no bundled ptxas to compile for sm_90 with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    code = HARNESS + textwrap.dedent(script) + "\nprint('COMPILED', ' '.join(compiled))\n"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-6000:]
    return done.stdout.rsplit("COMPILED", 1)[1].split()


def test_deepseek_v4_kernels_compile_for_sm90():
    """Every variant V4-Flash-8L's warm-up compiles (kernel_keys on the model built on the meta device: compressor,
    indexer scores and top-k, sparse attention, mHC pre), plus the top-k's split launch (chunks, then the merge) at
    both radix widths and the mHC post-mix, which no key covers."""
    compiled = _compile_in_subprocess("""
        from surge.attention.deepseek_v4_triton import DeepseekV4Kernels
        from surge.kernels.indexer_topk import IndexerTopK, split_launch
        from surge.kernels.mhc import mhc_post
        from surge.model.loader.base import build_model
        from surge.model.presets import preset_model_config

        cpu = torch.device("cpu")
        model = build_model(preset_model_config("deepseek-v4-flash-8l", "bfloat16", cpu, 4096), torch.device("meta"))
        for kernel, keys in model.kernel_keys(DeepseekV4Kernels.on(cpu), 64).items():
            assert keys, kernel
            for key in dict.fromkeys(keys):
                kernel.compile(key)
        topk, lengths = IndexerTopK(cpu), torch.tensor([1, 700], dtype=torch.int32)
        for radix_bits in (4, 8):  # small: the compile time grows with the digits times the block
            topk(torch.randn(2, 1024), lengths, 64, launch=split_launch(1024, 64, 256, radix_bits))
        tc = model.tc
        streams = torch.randn(3, tc.hc_mult, tc.hidden_size, dtype=torch.bfloat16)
        mhc_post(torch.randn(3, tc.hidden_size, dtype=torch.bfloat16), streams, torch.rand(3, tc.hc_mult),
                 torch.rand(3, tc.hc_mult, tc.hc_mult))
        """)
    for name in ("_compress_kernel", "_score_kernel", "_chunk_topk_kernel", "_merge_topk_kernel",
                 "_sparse_attention_kernel", "_mhc_pre_kernel", "_mhc_post_kernel"):
        assert name in compiled


def test_fused_moe_quantized_variants_compile_for_sm90():
    """The fused MoE's variants: unquantized (bf16, and float32 as the dequantized experts run), fp8 in 128 x 128,
    32 x 32 and 48 x 32 blocks (K tiles narrowed to the block), fp8 per channel, and mxfp4; the fp8 ones also from a
    launch of 16-deep K tiles, which they widen to the 32 an fp8 dot needs."""
    compiled = _compile_in_subprocess("""
        from surge.kernels.fused_moe import GemmTiles, MoeLaunch, MoeQuant, fused_moe

        fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
        e, t, k, h, i = 4, 5, 2, 256, 128
        weights, ids = torch.rand(t, k), torch.randint(0, e, (t, k))

        def run(x, gate_up, down, quant=None, launch=None):
            fused_moe(x, gate_up, down, weights.to(x.dtype), ids, launch=launch, quant=quant)

        for dtype in (bf16, torch.float32):
            dense = torch.randn(e, 2 * i, h, dtype=dtype), torch.randn(e, h, i, dtype=dtype)
            run(torch.randn(t, h, dtype=dtype), *dense)
        gate_up, down = torch.zeros(e, 2 * i, h, dtype=fp8), torch.zeros(e, h, i, dtype=fp8)
        narrow = MoeLaunch(16, GemmTiles(32, 16, 4, 2), GemmTiles(32, 16, 4, 2))  # fp8 dots take K >= 32: widened
        for bn, bk in ((128, 128), (32, 32), (48, 32)):
            scales = (torch.ones(e, 2 * -(-i // bn), -(-h // bk)), torch.ones(e, -(-h // bn), -(-i // bk)))
            run(torch.randn(t, h, dtype=bf16), gate_up, down, MoeQuant("fp8_block", *scales, block=(bn, bk)))
        run(torch.randn(t, h, dtype=bf16), gate_up, down, MoeQuant("fp8_block", *scales, block=(bn, bk)), narrow)
        run(torch.randn(t, h, dtype=bf16), gate_up, down,
            MoeQuant("fp8_channel", torch.ones(e, 2 * i), torch.ones(e, h)), narrow)
        u8 = torch.uint8
        blocks = (torch.zeros(e, 2 * i, h // 32, 16, dtype=u8), torch.zeros(e, h, i // 32, 16, dtype=u8))
        scales = (torch.zeros(e, 2 * i, h // 32, dtype=u8), torch.zeros(e, h, i // 32, dtype=u8))
        run(torch.randn(t, h, dtype=bf16), *blocks, MoeQuant("mxfp4", *scales))
        """)
    assert compiled.count("_gate_up_act_kernel") == 8 and compiled.count("_down_weighted_kernel") == 8


def test_moe_warm_up_compiles_for_sm90_what_the_launches_then_find_compiled():
    """The MoE warm-up's compile (fused_moe and the router run on meta tensors, each launch compiled alone) builds
    real sm_90 variants, and afterwards the launches at its token counts (on CPU tensors) compile no MoE kernel:
    Triton's own cache finds each. Unquantized (the pair path at 1 token, the grouped one beyond, the alignment in
    one launch and in two) and fp8_block (its activation scales' strides follow the token count)."""
    compiled = _compile_in_subprocess("""
        from triton.runtime.jit import JITFunction

        from surge.kernels.fused_moe import FUSED_MOE, MoeExperts, MoeQuant, fused_moe
        from surge.kernels.moe_routing import ROUTER, route

        misses = []
        _do_compile = JITFunction._do_compile

        def counted(self, *args, **kwargs):
            misses.append(self.__name__)
            return _do_compile(self, *args, **kwargs)

        JITFunction._do_compile = counted
        bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
        e, k, h, i = 8, 2, 256, 128
        dense = torch.randn(e, 2 * i, h, dtype=bf16), torch.randn(e, h, i, dtype=bf16)
        quant = MoeQuant("fp8_block", torch.ones(e, 2, 2), torch.ones(e, 2, 1))
        fp8_weights = torch.zeros(e, 2 * i, h, dtype=fp8), torch.zeros(e, h, i, dtype=fp8)
        cases = [(t, dense, None) for t in (1, 3, 16, 2500)] + [(t, fp8_weights, quant) for t in (3, 16)]

        def meta(*shape, dtype=bf16):
            return torch.empty(*shape, dtype=dtype, device="meta")

        ROUTER.compile_many([ROUTER.dispatch(num_tokens=t, num_experts=e, top_k=k, logits_dtype=bf16,
                                             weights_dtype=bf16, renormalize=True) for t, _, _ in cases])
        FUSED_MOE.compile_many([FUSED_MOE.dispatch(t, MoeExperts.of(
            meta(t, h), *w, meta(t, k), meta(t, k, dtype=torch.int32), quant=q)) for t, w, q in cases])
        warm = len(misses)
        assert {"_router_kernel", "_pair_gate_up_kernel", "_token_down_kernel", "_align_one_program_kernel",
                "_align_count_kernel", "_align_place_kernel", "_gate_up_act_kernel", "_down_weighted_kernel",
                "_combine_kernel"} <= set(misses), misses
        for t, w, q in cases:
            weights, ids = route(torch.randn(t, e, dtype=bf16), k, True, bf16)
            fused_moe(torch.randn(t, h, dtype=bf16), *w, weights, ids, quant=q)
        moe = [name for name in misses[warm:] if name not in ("_per_group_kernel",)]
        compiled.clear()
        compiled.extend(["WARM", str(warm)] + moe)
        """)
    assert compiled[:1] == ["WARM"] and int(compiled[1]) >= 10, compiled
    assert compiled[2:] == [], f"compiled at launch despite the warm-up: {compiled[2:]}"
