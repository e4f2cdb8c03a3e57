"""Our Triton kernels compiled for the GPU (Hopper, sm_90) on the CPU, by Triton's own compiler: the interpreter
the other kernel tests run on executes Python, so it accepts code the compiler refuses (a variable given another
shape in each branch of an `if` ran interpreted and failed to compile on the H100). Each kernel at the dtypes
and block sizes the worker launches it with for a Qwen2.5-1.5B shape in bf16."""

from __future__ import annotations

from typing import Any

import pytest

triton = pytest.importorskip("triton")


def compiled(
    kernel: Any, pointers: dict[str, str], constexprs: dict[str, Any], aligned: tuple[str, ...] = (), **options: Any
) -> str:
    """`kernel` compiled to PTX for sm_90: `pointers` name each pointer argument's element type; the other
    non-constexpr arguments are 32-bit integers, but `scale` and `eps` (float32). Pointers 16-byte aligned, and the
    integers named in `aligned` multiples of 16 (Triton specialises a launch on both)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    floats = {"scale", "eps"}
    signature = {
        n: pointers.get(n) or ("constexpr" if n in constexprs else "fp32" if n in floats else "i32") for n in names
    }
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in pointers or n in aligned}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


NF4_POINTERS = {"packed": "*u8", "absmax": "*fp32", "code": "*fp32", "extra": "*bf16", "out": "*bf16"}


def test_nf4_dequantise_compiles_with_whole_bytes_per_load() -> None:
    from worker.fastpath import nf4

    for blocksize in (64, 4096):  # bitsandbytes' default blocks, and its largest (two blocks a program)
        constexprs = {"ROWS": nf4.blocks_a_program(blocksize), "HALF": blocksize // 2}
        sizes = ("n_out", "n_bytes", "n_extra")  # a Qwen2.5-1.5B projection's: multiples of 16
        ptx = compiled(nf4._nf4_kernel, NF4_POINTERS, constexprs, sizes, num_warps=nf4.WARPS)
        # The packed bytes load 16 at a time, not byte by byte.
        assert ".entry _nf4_kernel" in ptx
        assert "ld.global.b8" not in ptx and "ld.global.v4.b32" in ptx


def test_decode_attention_compiles() -> None:
    from worker.fastpath import decode_attention as da

    pointers = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "first": "*i64", "last": "*i64", "out": "*bf16"}
    constexprs = {"G": da.MIN_QUERY_ROWS, "D": 128, "BLOCK": da.BLOCK_N, "BLOCKS": 0}
    assert ".entry _decode_attention_kernel" in compiled(da._decode_attention_kernel, pointers, constexprs)


def test_greedy_choice_compiles() -> None:
    from worker.fastpath import greedy
    from worker.fastpath.pointwise import cdiv

    parts = {"part_max": "*fp32", "part_at": "*i32", "part_sum": "*fp32", "part_bad": "*i32"}
    vocab = 151936
    piece = cdiv(cdiv(vocab, greedy.SPLITS), greedy.BLOCK) * greedy.BLOCK
    slices = {"V": vocab, "SLICE": piece, "BLOCK": greedy.BLOCK, "SPLITS": greedy.SPLITS, "LIBDEVICE": True}
    assert ".entry _greedy_slices" in compiled(greedy._greedy_slices, {"logits": "*bf16", **parts}, slices)
    outs = {"token_out": "*i64", "logprob_out": "*fp32", "finite_out": "*i1"}
    combine = {"SPLITS": greedy.SPLITS, "LIBDEVICE": True}
    assert ".entry _greedy_combine" in compiled(greedy._greedy_combine, {**parts, **outs}, combine)


def test_pointwise_kernels_compile() -> None:
    from worker.fastpath import pointwise

    rope = {"x": "*bf16", "cos": "*bf16", "sin": "*bf16", "out": "*bf16"}
    assert ".entry _rope_kernel" in compiled(pointwise._rope_kernel, rope, {"BH": 16, "D": 128})
    silu = {"gate": "*bf16", "up": "*bf16", "out": "*bf16"}
    assert ".entry _silu_mul_kernel" in compiled(pointwise._silu_mul_kernel, silu, {"BLOCK": 1024, "LIBDEVICE": True})
    rms = {"h": "*bf16", "delta": "*bf16", "weight": "*bf16", "h_out": "*bf16", "x_out": "*bf16"}
    add_rms = {"BLOCK": 2048, "LIBDEVICE": True}
    assert ".entry _add_rms_kernel" in compiled(pointwise._add_rms_kernel, rms, add_rms, num_warps=8)
