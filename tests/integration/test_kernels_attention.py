"""The C++ backend's prefill attention (`kernels/csrc/attention.cpp`) against the reference's
`prefill_attention` computed in float32 from the same bfloat16 inputs: the flash kernel (bfloat16,
AVX512_BF16, head_dim a multiple of 32) and its AMX form within the error torch's own bfloat16 kernel
makes, and every
other case (float32, another head_dim, an AVX2 or scalar build, which have no bfloat16 dot product)
through torch's kernel, equal to the reference's. Paged K/V in shuffled blocks; whole prompts, chunks
against a cached prefix, decode rows between them (left alone), GQA and MHA."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels.reference import prefill_attention
from tests.integration.conftest import cpu_build_ops

BUILDS = {
    "native": None,
    "avx2": ("conveyor_attention_avx2", ["-O3", "-mavx2", "-mfma", "-mno-avx512f"]),
    "scalar": ("conveyor_attention_scalar", ["-O3", "-mno-avx", "-mno-avx2"]),
}
# (query heads, KV heads, head_dim, q_lens, seq_lens, block_size): a q_len of 1 is a decode row
# the op leaves alone; q_len < seq_len is a chunk whose prefix is cached.
CASES = [
    (9, 3, 64, [37], [37], 16),
    (9, 3, 64, [5, 100], [5, 300], 16),
    (9, 3, 64, [64, 1, 33], [64, 90, 200], 16),
    (8, 8, 128, [50], [50], 32),
    (4, 1, 96, [70, 2], [70, 129], 16),
    (4, 2, 80, [40], [40], 16),  # head_dim 80: torch's kernel
]


@pytest.fixture(scope="module", params=list(BUILDS))
def ops(request: pytest.FixtureRequest):
    return cpu_build_ops(
        "attention.cpp", "CONVEYOR_ATTENTION_NAMESPACE", BUILDS[request.param], "conveyor_attention"
    )


def _inputs(heads, kv_heads, dim, q_lens, seq_lens, block_size, dtype):
    torch.manual_seed(sum(seq_lens) + dim)
    used = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(used) + 3
    key_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, dim).to(dtype)
    order = torch.randperm(num_blocks).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(used), dtype=torch.int32)
    taken = 0
    for b, n in enumerate(used):
        tables[b, :n] = order[taken : taken + n]
        taken += n
    query = torch.randn(sum(q_lens), heads, dim).to(dtype)
    starts = [sum(q_lens[:b]) for b in range(len(q_lens))]
    return query, key_cache, value_cache, tables, starts


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[1]}x{c[2]}-q{c[3]}-s{c[4]}" for c in CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_prefill_attention_matches_the_reference(ops, case, dtype, request: pytest.FixtureRequest):
    heads, kv_heads, dim, q_lens, seq_lens, block_size = case
    query, key_cache, value_cache, tables, starts = _inputs(*case, dtype)
    scale = dim**-0.5
    sentinel = 7.0  # decode rows keep what the caller wrote there
    out = torch.full(query.shape, sentinel, dtype=dtype)
    ops.prefill_attention(out, query, key_cache, value_cache, tables, q_lens, starts, seq_lens, scale)
    exact = torch.zeros(query.shape)
    prefill_attention(exact, query.float(), key_cache.float(), value_cache.float(), tables, q_lens, starts,
                      seq_lens, scale)  # fmt: skip
    torchs = torch.zeros(query.shape, dtype=dtype)
    prefill_attention(torchs, query, key_cache, value_cache, tables, q_lens, starts, seq_lens, scale)
    prefill_rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, q_lens, strict=True) if n > 1])
    decode_rows = [s for s, n in zip(starts, q_lens, strict=True) if n == 1]
    assert (out[decode_rows] == sentinel).all()
    flash = request.node.callspec.params["ops"] == "native" and ops.flash_supported(query)
    if not flash:  # torch's kernel on the same inputs, as the reference runs it
        torch.testing.assert_close(out[prefill_rows], torchs[prefill_rows], rtol=0, atol=0)
        return
    error = (out.float() - exact)[prefill_rows].abs().max().item()
    torch_error = (torchs.float() - exact)[prefill_rows].abs().max().item()
    assert error <= 1.5 * torch_error + 1e-3, (error, torch_error)


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[1]}x{c[2]}-q{c[3]}-s{c[4]}" for c in CASES])
def test_the_amx_kernel_matches_the_reference(case):
    """The flash kernel on AMX tiles (`amx`, chosen by measurement where the CPU has AMX-BF16), within
    the error torch's own bfloat16 kernel makes; head_dim 80 falls back to torch's kernel exactly."""
    ops = cpu_build_ops("attention.cpp", "CONVEYOR_ATTENTION_NAMESPACE", None, "conveyor_attention")
    heads, kv_heads, dim, q_lens, seq_lens, block_size = case
    query, key_cache, value_cache, tables, starts = _inputs(*case, torch.bfloat16)
    if not ops.amx_supported(torch.zeros(1, 1, 64, dtype=torch.bfloat16)):
        pytest.skip("this CPU (or build) has no AMX-BF16 tiles: the amx kernel is not a candidate here")
    scale = dim**-0.5
    out = torch.full(query.shape, 7.0, dtype=torch.bfloat16)
    try:
        ops.set_prefill_kernels(heads, kv_heads, dim, [1], ["amx"])
        ops.prefill_attention(out, query, key_cache, value_cache, tables, q_lens, starts, seq_lens, scale)
    finally:
        ops.set_prefill_kernels(heads, kv_heads, dim, [1], ["flash"])
    exact = torch.zeros(query.shape)
    prefill_attention(exact, query.float(), key_cache.float(), value_cache.float(), tables, q_lens, starts,
                      seq_lens, scale)  # fmt: skip
    torchs = torch.zeros(query.shape, dtype=torch.bfloat16)
    prefill_attention(torchs, query, key_cache, value_cache, tables, q_lens, starts, seq_lens, scale)
    prefill_rows = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, q_lens, strict=True) if n > 1])
    decode_rows = [s for s, n in zip(starts, q_lens, strict=True) if n == 1]
    assert (out[decode_rows] == 7.0).all()
    if not ops.amx_supported(query):
        torch.testing.assert_close(out[prefill_rows], torchs[prefill_rows], rtol=0, atol=0)
        return
    error = (out.float() - exact)[prefill_rows].abs().max().item()
    torch_error = (torchs.float() - exact)[prefill_rows].abs().max().item()
    assert error <= 1.5 * torch_error + 1e-3, (error, torch_error)


def test_the_flash_kernel_runs_where_the_cpu_has_bfloat16_dot_products(ops, request: pytest.FixtureRequest):
    if not torch.cpu._is_avx512_bf16_supported():
        pytest.skip("this CPU has no AVX512_BF16: torch's kernel runs everywhere (checked above)")
    native = request.node.callspec.params["ops"] == "native"
    assert ops.flash_supported(torch.zeros(2, 3, 64, dtype=torch.bfloat16)) == native
    assert not ops.flash_supported(torch.zeros(2, 3, 64))  # float32
    assert not ops.flash_supported(torch.zeros(2, 3, 80, dtype=torch.bfloat16))


def test_the_chosen_kernel_runs_each_sequence_by_its_query_rows():
    """`set_prefill_kernels` (what `selection.select_prefill_attention` sets at start): the flash kernel
    up to 64 query rows, torch's from 65 on, for this attention shape only; each sequence's rows equal
    that kernel's alone, bit for bit. A bad table is refused with a message."""
    ops = cpu_build_ops("attention.cpp", "CONVEYOR_ATTENTION_NAMESPACE", None, "conveyor_attention")
    case = (9, 3, 64, [64, 100], [64, 300], 16)
    query, key_cache, value_cache, tables, starts = _inputs(*case, torch.bfloat16)
    if not ops.flash_supported(query):
        pytest.skip("this CPU has no AVX512_BF16: torch's kernel is the only one")
    q_lens, seq_lens = case[3], case[4]

    def run(first_rows, kernels, heads=(9, 3, 64)):
        ops.set_prefill_kernels(*heads, first_rows, kernels)
        out = torch.zeros_like(query)
        ops.prefill_attention(out, query, key_cache, value_cache, tables, q_lens, starts, seq_lens, 0.125)
        return out

    try:
        flash, sdpa = run([1], ["flash"]), run([1], ["sdpa"])
        assert not torch.equal(flash[64:], sdpa[64:])  # the two kernels round differently
        split = run([1, 65], ["flash", "sdpa"])
        assert torch.equal(split[:64], flash[:64]) and torch.equal(split[64:], sdpa[64:])
        # another shape's table leaves this one's alone
        assert torch.equal(run([1], ["flash"], heads=(8, 8, 128)), split)
        if ops.amx_supported(query):
            amx = run([1], ["amx"])
            assert not torch.equal(amx[64:], sdpa[64:])
            assert torch.equal(run([1, 65], ["sdpa", "amx"])[64:], amx[64:])
        with pytest.raises(RuntimeError, match="unknown kernel 'tiles' \\(flash, amx or sdpa\\)"):
            ops.set_prefill_kernels(9, 3, 64, [1], ["tiles"])
        with pytest.raises(RuntimeError, match="must start at 1"):
            ops.set_prefill_kernels(9, 3, 64, [2], ["sdpa"])
    finally:
        ops.set_prefill_kernels(9, 3, 64, [1], ["flash"])
