"""Our rotary and SiLU x up Triton kernels (worker/fastpath/pointwise.py), run on the CPU by Triton's interpreter:
rotary bit-equal to eager (the kernel rounds each product, then the sum, as eager does), SiLU x up to eager's
float32 within the exp's last bits, and the decode loop with the kernels token for token as without them. The
interpreter must be chosen before Triton is imported, so each check runs in a fresh interpreter process. (The
same comparisons on the GPU, in bf16: `python -m bench kernels`.)"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(script: str, *args: str) -> str:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_rotary_is_bit_equal_and_silu_mul_matches_eager() -> None:
    out = run_interpreted("""
        import torch
        from worker.fastpath import ops, pointwise
        torch.manual_seed(0)
        for dtype in (torch.float32, torch.float16):
            # q/k heads of a joint q/k/v output (strided rows), 14 heads (under one block) and 20 (over it);
            # cos/sin shared by the rows (prefill) or one per row (decode; several tokens: scoring's continuations).
            shapes = ((2, 5, 14, False), (3, 1, 14, True), (2, 3, 14, True), (2, 3, 20, False))
            for rows, length, heads, per_row in shapes:
                joint = torch.randn(rows, length, (heads + 2) * 16).to(dtype)
                qk = joint[..., : heads * 16].view(rows, length, heads, 16)
                cos = torch.randn(rows if per_row else 1, length, 16).to(dtype)
                sin = torch.randn_like(cos)
                got = pointwise.rope(qk, cos, sin)
                assert got.shape == qk.shape and got.is_contiguous()
                assert torch.equal(got, ops.rope(qk, cos.unsqueeze(2), sin.unsqueeze(2))), (dtype, rows, heads)
            gate_up = torch.randn(3, 4, 2 * 1100).to(dtype) * 4
            gate, up = gate_up.split(1100, dim=-1)  # a joint gate/up output's halves: strided, 2 blocks a row
            got = pointwise.silu_mul(gate, up)
            want = ops.silu_mul(gate, up)
            assert got.shape == gate.shape and got.dtype == dtype
            # float16: the same roundings, so at most an ulp apart where exp's last bit tips one.
            tight = dtype == torch.float32
            torch.testing.assert_close(got, want, rtol=1e-6 if tight else 1e-3, atol=1e-6 if tight else 1e-3)
            # Into a slice of a larger buffer (prefill's MLP writes each block's product into the chunk's): the
            # same values there, the rest of the buffer untouched, the slice itself handed back.
            whole = torch.full((5, 4, 1100), 7.0, dtype=dtype)
            into = pointwise.silu_mul(gate, up, out=whole[1:4])
            assert into.data_ptr() == whole[1:4].data_ptr() and torch.equal(whole[1:4], got)
            assert bool((whole[0] == 7).all()) and bool((whole[4] == 7).all())
            try:
                pointwise.silu_mul(gate, up, out=whole[1:4, :2])
            except ValueError:
                pass
            else:
                raise AssertionError("a wrongly shaped out was written")
            # The eager fallback (kernels off) writes into the same slice.
            kernels_off = ops.Ops(compiled=False)
            whole.fill_(7.0)
            back = kernels_off.act_mul(torch.nn.SiLU(), gate, up, out=whole[1:4])
            assert back.data_ptr() == whole[1:4].data_ptr() and torch.equal(whole[1:4], want)
            assert bool((whole[0] == 7).all())
        print("ok")
    """)
    assert out.strip() == "ok"


def test_add_rms_gives_the_residual_sum_exactly_and_its_norm_as_eager_does() -> None:
    """The residual sum is rounded as eager rounds it (bit-equal); the norm's sum of squares runs in another
    order, so the normed output is eager's within float rounding (as the compiled function's is)."""
    out = run_interpreted("""
        import torch
        from worker.fastpath import ops, pointwise
        torch.manual_seed(0)
        for dtype in (torch.float32, torch.float16):
            for rows, features in ((3, 96), (2, 1536), (5, 100)):  # 100: a row shorter than its block
                h = (torch.randn(rows, 4, features) * 3).to(dtype)
                delta = torch.randn(rows, 4, features).to(dtype)
                weight = (torch.rand(features) + 0.5).to(dtype)
                assert pointwise.add_rms_fits(h, delta, weight)
                total, normed = pointwise.add_rms(h, delta, weight, 1e-6)
                want_total, want_normed = ops.add_rms(h, delta, weight, 1e-6)
                assert total.shape == h.shape and normed.dtype == dtype
                assert torch.equal(total, want_total), (dtype, rows, features)
                tol = 1e-5 if dtype == torch.float32 else 1e-3
                torch.testing.assert_close(normed, want_normed, rtol=tol, atol=tol)
        h = torch.randn(2, 8)
        assert not pointwise.add_rms_fits(h.half(), h.half(), h[0])  # a float32 weight would promote eager's product
        print("ok")
    """)
    assert out.strip() == "ok"


def test_prefill_runs_the_kernels_decode_steps_only_when_asked_and_tokens_stay_the_same(tiny_models: Path) -> None:
    """Prefill runs the kernels wherever they are available (a take of one new token calls them), decode steps
    only with `OpsOptions(pointwise_kernels=True)` (the worker's `--pointwise-kernels`); Kev, Laya and mixed rows in
    float32 get the same tokens and log-probabilities with the kernels in prefill, in both, and in neither
    (`OpsOptions(compile_ops=False)`: the eager functions everywhere)."""
    from tests.conftest import tiny_config

    config_path = tiny_config(tiny_models, "none").path
    out = run_interpreted(
        """
        import sys
        import torch
        from tests.test_fastpath import PROMPTS
        from worker.config import load_config
        from worker.engine import Engine
        from worker.fastpath import DecodeRow, OpsOptions, pointwise
        from worker.loading import select_adapters

        calls = {"rope": 0, "silu_mul": 0, "add_rms": 0}
        for name in calls:
            def counted(*args, _fn=getattr(pointwise, name), _name=name, **kw):
                calls[_name] += 1
                return _fn(*args, **kw)
            setattr(pointwise, name, counted)
        config = load_config(sys.argv[1])
        plain_engine = Engine(config, device="cpu", decode="static")
        bases = plain_engine.bases
        ours_engine = Engine(config, device="cpu", decode="static", bases=bases, ops=OpsOptions(pointwise_kernels=True))
        none_engine = Engine(config, device="cpu", decode="static", bases=bases, ops=OpsOptions(compile_ops=False))
        (base,), (plain,) = plain_engine.bases.values(), plain_engine.decoders.values()
        (ours,), (none,) = ours_engine.decoders.values(), none_engine.decoders.values()
        assert plain.stack.prefill_ops.kernels and not plain.stack.step_ops.kernels and not plain.stack.ops.kernels
        assert ours.stack.prefill_ops.kernels and ours.stack.step_ops.kernels
        assert not none.stack.prefill_ops.kernels and not none.stack.step_ops.kernels
        kw = {"stop_ids": [-1], "pad_id": base.tokenizer.pad_token_id, "select": lambda n: select_adapters(base, n)}
        ids = [base.tokenizer(PROMPTS[i % len(PROMPTS)]).input_ids for i in range(5)]

        def counted_decode(decoder, rows):
            calls.update(rope=0, silu_mul=0, add_rms=0)
            return decoder.decode(rows, **kw), dict(calls)

        _, prefill_only = counted_decode(plain, [DecodeRow(ids=r, max_new=1, adapter="kev") for r in ids])
        layers = len(plain.stack.layers)
        assert prefill_only["rope"] == prefill_only["silu_mul"] > 0 and prefill_only["rope"] % layers == 0
        assert prefill_only["add_rms"] == 2 * prefill_only["rope"]  # after attention and after the MLP (prefill only)
        for adapters in (["kev"], ["laya"], ["kev", "laya"]):
            rows = [DecodeRow(ids=r, max_new=6, adapter=adapters[i % len(adapters)]) for i, r in enumerate(ids)]
            (a, in_ours), (b, in_plain), (c, in_none) = (counted_decode(d, rows) for d in (ours, plain, none))
            for x in (a, b):
                assert torch.equal(x.tokens, c.tokens), adapters
                torch.testing.assert_close(x.logprobs, c.logprobs, rtol=1e-6, atol=1e-6)
            assert in_none == {"rope": 0, "silu_mul": 0, "add_rms": 0}, in_none
            assert in_plain == prefill_only, (in_plain, prefill_only)  # its decode steps call none
            steps = {k: in_ours[k] - in_plain[k] for k in calls}
            # 5 steps after the first token; the residual-add-and-norm kernel is prefill's only
            assert steps == {"rope": 5 * layers, "silu_mul": 5 * layers, "add_rms": 0}, steps
        print("ok", prefill_only)
    """,
        str(config_path),
    )
    assert out.startswith("ok")


class FakeCompiled:
    """What Triton's launch hands back: `run` launches it again (here: `kernel`, or a wrong result)."""

    def __init__(self, kernel: Any, wrong: bool) -> None:
        self.kernel, self.wrong = kernel, wrong
        self.function, self.packed_metadata = "function", "metadata"
        self.runs = 0

    def launch_metadata(self, grid: Any, stream: Any, *values: Any) -> None:
        return None

    def run(self, g0: int, g1: int, g2: int, stream: Any, function: Any, meta: Any, launch: Any, *rest: Any) -> None:
        _hooks, values = rest[:2], rest[2:]
        self.runs += 1
        self.kernel.write(*values, offset=1.0 if self.wrong else 0.0)


class FakeKernel:
    """A Triton kernel's stand-in: out = x * SCALE (its arguments x, out, SCALE: constexpr)."""

    def __init__(self, wrong: bool = False) -> None:
        self.arg_names = ["x", "out", "SCALE"]
        self.wrong = wrong
        self.launches = 0
        self.compiled = FakeCompiled(self, wrong)

    def write(self, x: Any, out: Any, scale: float, offset: float = 0.0) -> None:
        out.copy_(x * scale + offset)

    def __getitem__(self, grid: Any) -> Any:
        def launch(x: Any, out: Any, SCALE: float, **options: Any) -> FakeCompiled:
            self.launches += 1
            self.write(x, out, SCALE)
            return self.compiled

        return launch


@pytest.mark.parametrize("wrong", [False, True])
def test_the_launcher_goes_direct_only_after_a_launch_through_it_gave_the_same_outputs(
    monkeypatch: pytest.MonkeyPatch, wrong: bool
) -> None:
    """Launcher: the first launch of a specialisation is Triton's own, then one through the compiled launcher
    whose outputs must equal it; trusted, later launches go direct. A launcher that gives other outputs is never
    used again, and the outputs are Triton's own."""
    import torch

    from worker.fastpath import pointwise

    monkeypatch.setattr(pointwise, "INTERPRETED", False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: type("S", (), {"cuda_stream": 0})())
    kernel = FakeKernel(wrong=wrong)
    launcher = pointwise.Launcher(kernel, outputs=(1,), enable_fp_fusion=False)
    assert launcher.direct
    x = torch.arange(4.0)
    for _ in range(3):
        out = torch.empty(4)
        launcher((1, 1), x, out, SCALE=2.0)
        assert torch.equal(out, x * 2)
    assert kernel.launches == (3 if wrong else 1)
    assert kernel.compiled.runs == (1 if wrong else 3)  # the trial launch, then (trusted) every later one
    assert launcher.direct is not wrong


def test_the_fused_greedy_choice_is_torchs() -> None:
    """Our greedy-choice kernel (worker/fastpath/greedy.py) against `token_choice` on the float32 logits: the same
    token (the first of equal maxima, across the kernel's blocks too), a non-finite row ending with `end_id` and
    flagged, the log-probability within float32 rounding (its sum runs in another order)."""
    out = run_interpreted("""
        import torch
        from worker.fastpath import greedy, sampling
        torch.manual_seed(0)
        vocab = 2 * greedy.BLOCK + 123  # three blocks, the last one partial
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            logits = (torch.randn(6, vocab) * 3).to(dtype)
            logits[1, 7] = logits[1, greedy.BLOCK + 5] = logits[1].max() + 1  # a tie across blocks: the first wins
            logits[2, vocab - 1] = logits[2].max() + 2  # the maximum in the partial block
            logits[3, 11] = float("nan")
            logits[4, 5] = float("-inf")
            logits[5, 9] = float("inf")
            assert greedy.KERNEL.serves(logits)
            token, logprob, finite = greedy.KERNEL(logits, 2)
            want_token, want_logprob, want_finite, _ = sampling.token_choice(logits.float(), 2)
            assert torch.equal(token, want_token), (dtype, token, want_token)
            assert torch.equal(finite, want_finite) and finite.tolist() == [True, True, True, False, False, False]
            assert token[1] == 7 and token[2] == vocab - 1 and token[3:].tolist() == [2, 2, 2]
            torch.testing.assert_close(logprob[:3], want_logprob[:3], rtol=1e-6, atol=1e-6)
            chunked = sampling.greedy_choice(logits, 2)  # the step's entry point runs the kernel here
            assert torch.equal(chunked[0], want_token)
        print("ok")
    """)
    assert out.strip() == "ok"


def test_our_nf4_dequantise_is_bitsandbytes_and_keeps_its_appended_rows() -> None:
    """Our NF4 kernel (worker/fastpath/nf4.py) reads bitsandbytes' packing: bit-equal to the format's arithmetic
    (the code's float32 value times the block's scale, rounded once) and to bitsandbytes' own CPU dequantise at
    its default blocks of 64 (fp16 and fp32 here; the interpreter rounds bf16 by truncation, so bf16 against
    bitsandbytes' CUDA op is checked on the GPU), in blocks of 64, 128 and 4,096 (two blocks a program), with a
    partial last program, an odd-sized last block, and the extra rows appended exactly."""
    out = run_interpreted("""
        import torch
        import bitsandbytes.functional as bnb
        from worker.fastpath import nf4
        torch.manual_seed(0)
        for dtype in (torch.float16, torch.float32):
            cases = ((96, 128, 64, 5), (24, 320, 128, 0), (3, 64, 64, 1), (5, 24, 64, 0), (2, 4096, 4096, 2))
            for rows, cols, blocksize, more in cases:
                weight = torch.randn(rows, cols, dtype=dtype) * 3
                packed, state = bnb.quantize_4bit(weight, blocksize=blocksize, quant_type="nf4")
                # The format: the first element of a byte in its high nibble, one scale per block.
                codes = torch.stack((packed.flatten().long() >> 4, packed.flatten().long() & 15), 1).flatten()
                scales = state.absmax.float().repeat_interleave(blocksize)[: rows * cols]  # a last block may be short
                want = (state.code.float()[codes] * scales).to(dtype).view(rows, cols)
                if blocksize == 64:  # bitsandbytes' own CPU dequantise (its blocks of 128 read otherwise on the CPU)
                    own = torch.ops.bitsandbytes.dequantize_4bit.default(
                        packed, state.absmax, blocksize, "nf4", [rows, cols], dtype)
                    assert torch.equal(own, want)
                extra = torch.randn(more, cols, dtype=dtype) if more else None
                assert nf4.serves(packed.device, dtype, "nf4", blocksize) and not nf4.serves(
                    packed.device, dtype, "fp4", blocksize)
                assert not nf4.serves(packed.device, dtype, "nf4", 48)  # blocks of whole bytes, a power of two
                got = nf4.dequantize(packed, state.absmax.float(), nf4.code_table(state.code), shape=(rows, cols),
                                     blocksize=blocksize, dtype=dtype, extra=extra)
                assert got.shape == (rows + more, cols)
                assert torch.equal(got[:rows], want), (dtype, rows, cols, blocksize)
                if more:
                    assert torch.equal(got[rows:], extra)
        print("ok")
    """)
    assert out.strip() == "ok"


def test_decode_with_lora_folded_into_our_nf4_matmul_keeps_its_tokens(tiny_models: Path) -> None:
    """The decode step's 4-bit matmuls by our kernel with every adapter's LoRA shrink folded in (`weights.Fold`:
    the A rows dequantised below the weight, one expand) against bitsandbytes' dequantise and the separate LoRA
    matmuls: Kev, Laya and mixed rows (each adapter's shrink masked per row) get the same tokens, and the
    log-probabilities agree within float16 rounding; the folded path really ran, with the adapters' rows."""
    from tests.conftest import tiny_config

    path = tiny_models / "models-nf4-fp16.toml"
    path.write_text(tiny_config(tiny_models, "nf4").path.read_text().replace('"float32"', '"float16"'))
    out = run_interpreted(
        """
        import sys
        import torch
        from tests.test_fastpath import PROMPTS
        from worker.config import load_config
        from worker.engine import Engine
        from worker.fastpath import DecodeRow, nf4, weights
        from worker.loading import select_adapters

        weights.OWN_4BIT_DEVICES = frozenset({"cuda", "cpu"})
        folded = []
        def counted(*args, _fn=nf4.dequantize, **kw):
            folded.append(kw.get("extra") is not None)
            return _fn(*args, **kw)
        nf4.dequantize = counted
        engine = Engine(load_config(sys.argv[1]), device="cpu", decode="static")
        (base,), (decoder,) = engine.bases.values(), engine.decoders.values()
        kw = {"stop_ids": [-1], "pad_id": base.tokenizer.pad_token_id, "select": lambda n: select_adapters(base, n)}
        ids = [base.tokenizer(PROMPTS[i % len(PROMPTS)]).input_ids for i in range(4)]
        for adapters in (["kev"], ["laya"], ["kev", "laya"]):
            rows = [DecodeRow(ids=r, max_new=4, adapter=adapters[i % len(adapters)]) for i, r in enumerate(ids)]
            nf4.KERNEL.on = True
            folded.clear()
            got = decoder.decode(rows, **kw)
            assert folded and any(folded), adapters
            nf4.KERNEL.on = False
            want = decoder.decode(rows, **kw)
            assert torch.equal(got.tokens, want.tokens), adapters
            torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-3, atol=1e-3)
        print("ok")
        """,
        str(path),
    )
    assert out.strip() == "ok"


def test_the_launcher_keys_integers_triton_specialises_on_their_value() -> None:
    """A compiled variant serves only the arguments Triton compiled it for: an integer it specialises (not
    `do_not_specialize`) is keyed by whether it is 1 and whether a multiple of 16 (a kernel compiled for a
    multiple of 16 vectorises on that promise), one it does not specialise by its width only."""
    from worker.fastpath import pointwise

    key = pointwise.specialisation
    assert key(4096, True) != key(4104, True) != key(1, True)
    assert key(4096, True) == key(8192, True)
    assert key(4096, False) == key(4104, False) == key(1, False)
    assert key(2**40, False) != key(4096, False)  # i64 against i32

    class Param:
        def __init__(self, fixed: bool) -> None:
            self.do_not_specialize = fixed

    kernel = FakeKernel(wrong=False)
    kernel.params = [Param(False), Param(True), Param(False)]  # type: ignore[attr-defined]
    assert tuple(pointwise.Launcher(kernel, outputs=(0,)).specialised) == (True, False, True)


def test_the_launchers_integer_key_splits_exactly_where_tritons_specialisation_does() -> None:
    """Against Triton's own specialiser (what its `run` compiles a variant per): two integers share our key
    exactly when Triton gives them the same specialisation, with value specialisation on and off."""
    pytest.importorskip("triton")
    from triton.backends import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    from worker.fastpath import pointwise

    values = (0, 1, 2, 15, 16, 17, 48, 8960, 17944, -1, -16, 2**31 - 1, 2**31, 2**40 + 8)
    for on_value in (True, False):
        triton_key = {v: native_specialize_impl(BaseBackend, v, False, on_value, True) for v in values}
        ours = {v: pointwise.specialisation(v, on_value) for v in values}
        for a in values:
            for b in values:
                assert (ours[a] == ours[b]) == (triton_key[a] == triton_key[b]), (on_value, a, b)
