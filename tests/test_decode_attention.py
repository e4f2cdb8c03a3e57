"""The decode step's attention kernel (worker/fastpath/decode_attention.py), run on the CPU by Triton's interpreter:
equal to SDPA under the mask of each row's columns (rows of one column, firsts on and off block edges, the
cache a strided view of a larger pool), and the decode loop with it token for token as with SDPA. (On the GPU, in
bf16: `tests/test_gpu.py`.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_pointwise import run_interpreted

pytest.importorskip("triton")


def test_decode_attention_equals_sdpa_under_the_rows_mask() -> None:
    out = run_interpreted("""
        import torch
        import torch.nn.functional as F
        from worker.fastpath.decode_attention import decode_attention, serves
        torch.manual_seed(0)
        for dtype in (torch.float32, torch.float16):
            # (rows, kv heads, query heads a KV head, columns, head size): Qwen's 6 query heads a KV head, one
            # (plain attention), and a power of two.
            for rows, kv_heads, groups, length, dim in ((4, 2, 6, 150, 64), (2, 1, 1, 70, 32), (3, 2, 4, 130, 16)):
                # The queries as the joint q/k/v output holds them: each row's heads side by side, K and V after.
                joint = torch.randn(rows, (kv_heads * groups + 2 * kv_heads) * dim).to(dtype)
                q = joint[:, : kv_heads * groups * dim].view(rows, kv_heads, groups, dim)
                # The cache as the KV pool hands it out: a view of a larger buffer (another layer's K beside it).
                pool = torch.randn(2, rows, kv_heads, length + 9, dim).to(dtype)
                k, v = pool[0, :, :, :length], pool[1, :, :, 5 : length + 5]
                last = torch.tensor([length - 7])
                first = torch.tensor([last.item(), 0, 64, 65][:rows])  # one column (bucket padding); block edges
                first[-1] = min(first[-1], last.item())
                cols = torch.arange(length)
                mask = ((cols >= first[:, None]) & (cols <= last[0])).view(rows, 1, 1, length)
                want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=0.3)
                assert serves(q, k, v)
                got = decode_attention(q, k, v, first, last, scale=0.3)
                assert got.shape == q.shape and got.dtype == dtype
                tol = 1e-5 if dtype == torch.float32 else 2e-3
                torch.testing.assert_close(got, want.to(dtype), rtol=tol, atol=tol)
        print("ok")
    """)
    assert out.startswith("ok")


def test_decode_loop_with_the_kernel_keeps_its_tokens(tiny_models: Path) -> None:
    """Kev rows, then Kev and Laya mixed, of different prompt lengths (each row starts at its own column), float32: the
    same tokens and log-probabilities with the kernel as with SDPA under the mask, the kernel run every layer of
    every step."""
    from tests.conftest import tiny_config

    config_path = tiny_config(tiny_models, "none").path
    out = run_interpreted(
        """
        import sys
        import torch
        from tests.test_fastpath import PROMPTS
        from worker.config import load_config
        from worker.engine import Engine
        from worker.fastpath import DecodeRow, decode_attention
        from worker.loading import select_adapters

        calls = [0]
        real = decode_attention.decode_attention
        def counted(*args, **kwargs):
            calls[0] += 1
            return real(*args, **kwargs)
        decode_attention.decode_attention = counted
        engine = Engine(load_config(sys.argv[1]), device="cpu", decode="static")
        (base,), (decoder,) = engine.bases.values(), engine.decoders.values()
        kw = {"stop_ids": [-1], "pad_id": base.tokenizer.pad_token_id, "select": lambda n: select_adapters(base, n)}
        ids = [base.tokenizer(PROMPTS[i % len(PROMPTS)] * (1 + i % 3)).input_ids for i in range(5)]
        assert len({len(r) for r in ids}) > 2
        layers = len(decoder.stack.layers)
        for adapters in (["kev"], ["kev", "laya"]):
            rows = [DecodeRow(ids=r, max_new=6, adapter=adapters[i % len(adapters)]) for i, r in enumerate(ids)]
            calls[0] = 0
            decode_attention.KERNEL.on = True
            ours = decoder.decode(rows, **kw)
            assert calls[0] == 5 * layers, calls  # every layer of the 5 steps after the first token
            decode_attention.KERNEL.on = False
            sdpa = decoder.decode(rows, **kw)
            assert torch.equal(ours.tokens, sdpa.tokens), adapters
            torch.testing.assert_close(ours.logprobs, sdpa.logprobs, rtol=1e-5, atol=1e-5)
        print("ok")
    """,
        str(config_path),
    )
    assert out.startswith("ok")
