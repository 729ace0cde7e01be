"""Kernels compile for the GPU, not only run in the interpreter. Triton's compiler (its AST code generator) rejects
constructs the interpreter runs: an annotated constexpr (`x: tl.constexpr = ...`) inside a static_range body was
"already defined" at the loop's second unrolled step on the H200 (indexer_topk._select). Triton compiles to sm_90
cubin without a GPU (its wheel carries ptxas), so each launch here is compiled for it in a subprocess: the test
process runs with TRITON_INTERPRET=1, under which the kernels are interpreted, not compiled."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def _compile_in_subprocess(script: str) -> None:
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton has no bundled ptxas to compile for sm_90 with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    prelude = textwrap.dedent("""
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        def compile_for_sm90(kernel, types, constexprs, num_warps):
            # types: each runtime argument's Triton type; every other argument is one of the constexprs
            signature = {name: types.get(name, "constexpr") for name in kernel.arg_names}
            missing = [n for n, t in signature.items() if t == "constexpr" and n not in constexprs]
            assert not missing, missing
            triton.compile(ASTSource(kernel, signature, constexprs=constexprs),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
        """)
    done = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(script)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]


def test_indexer_topk_compiles_for_sm90():
    """The short launch (one chunk) and the split one (chunks writing keys, then the merge), as _launch passes
    their constexprs, at every radix width the policy takes."""
    _compile_in_subprocess("""
        import triton
        from surge.kernels.indexer_topk import _chunk_topk_kernel, _merge_topk_kernel, launch_policy, split_launch

        chunk_types = dict(scores_ptr="*fp32", lengths_ptr="*i32", out_idx_ptr="*i32", out_key_ptr="*i32",
                           stride_s="i32", stride_o="i32")
        merge_types = dict(cand_idx_ptr="*i32", cand_key_ptr="*i32", lengths_ptr="*i32", out_ptr="*i32",
                           stride_c="i32", stride_o="i32")
        k = 128
        for launch in (launch_policy(256, k), split_launch(4096, k, 1024), launch_policy(256, k, radix_bits=8)):
            common = dict(K=k, K_PAD=triton.next_power_of_2(k), MAX_LEN=launch.block * launch.num_chunks,
                          RADIX_BITS=launch.radix_bits)
            compile_for_sm90(_chunk_topk_kernel, chunk_types, dict(BLOCK=launch.block, NUM_CHUNKS=launch.num_chunks,
                             WRITE_KEYS=launch.split, **common), launch.num_warps)
            if launch.split:
                compile_for_sm90(_merge_topk_kernel, merge_types, dict(NUM_CANDIDATES=launch.num_chunks * k,
                                 BLOCK=launch.merge_block, **common), launch.merge_num_warps)
        """)
