"""The kernels compile for an H100/H200 (sm_90) down to a cubin, on any machine: Triton's
frontend and its bundled ptxas need no GPU. The interpreter does not type-check as the compiler
does (it accepted a function whose constexpr branches returned bf16 and fp32 tiles), so this is
the CPU-side guard for the GPU path; it also checks that weight tiles still load as 16-byte
async copies (a lost alignment hint silently turns them into 1-byte loads)."""

import os
import sys
import textwrap

import pytest

import proc

SCRIPT = textwrap.dedent(
    """
    import re, triton
    from triton.compiler import ASTSource
    from triton.backends.compiler import GPUTarget
    from pwgpu.kernels import moe_gemm, quant
    from pwgpu.kernels.layout import matrix_layout

    # Arguments a launch would specialise as multiples of 16 (aligned pointers, Mixtral sizes).
    DIV16 = {"x_ptr", "act_ptr", "y_ptr", "topk_weights", "sorted_slots", "block_expert", "class_blocks",
             "class_offsets", "pool", "page_tab", "first_page", "stride_xt", "H", "F", "scale_off", "zero_off",
             "groups_per_row", "w_ptr", "stride_wn", "out_ptr", "N", "K"}
    TYPES = {"x_ptr": "*bf16", "act_ptr": "*bf16", "y_ptr": "*fp32", "topk_weights": "*fp32", "w_ptr": "*bf16",
             "out_ptr": "*bf16", "pool": "*u8", "page_tab": "*i64", "first_page": "*i32", "sorted_slots": "*i32",
             "block_expert": "*i32", "class_blocks": "*i32", "class_offsets": "*i32"}

    def compile_sm90(fn, consts):
        sig = {a: "constexpr" if a in consts else TYPES.get(a, "i32") for a in fn.arg_names}
        if fn is quant._quantize_kernel or fn is quant._dequantize_kernel:
            sig["first_page"] = "i32"
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a in DIV16 and a not in consts}
        src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(c),): v for c, v in consts.items()}, attrs=attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})

    for prec in ("bf16", "fp8-b128", "fp8", "int4", "int3"):
        for gate_up, (n, k) in ((True, (14336, 4096)), (False, (4096, 14336))):
            lay = matrix_layout(prec, n, k)
            row_chunk, align16, packed = moe_gemm._chunk_flags(prec, n, k, 64, 1 << 21)
            consts = dict(FMT=lay.fmt, BITS=lay.bits, GROUP=lay.group_size or 1, PAGE_SHIFT=21, ROW_CHUNK=row_chunk,
                          CHUNK_ALIGN16=align16, FP8_NATIVE=True, DOT_FP32=False, PACKED=packed, BLOCK_M=16,
                          BLOCK_N=64, BLOCK_K=64)
            consts.update(TOP_K=2, ACT=0) if gate_up else consts.update(SPLIT_K=4)
            ptx = compile_sm90(moe_gemm._gate_up_kernel if gate_up else moe_gemm._down_kernel, consts).asm["ptx"]
            copies16 = len(re.findall(r"cp\\.async\\.\\w+\\.shared\\.global[^\\]]*\\], \\[[^\\]]*\\], 0x10", ptx))
            print(f"gemm {prec} {'gate_up' if gate_up else 'down'} row_chunk={row_chunk} copies16={copies16}")
            if prec == "bf16" and gate_up:  # the GELU epilogues (erf, and tanh written with a sigmoid)
                for act in (1, 2):
                    compile_sm90(moe_gemm._gate_up_kernel, dict(consts, ACT=act))
                print("gemm gelu ok")
        lay = matrix_layout(prec, 4096, 4096)
        block_n = lay.group_size if lay.group_rows > 1 else 16  # fp8-b128: one program per scale block
        compile_sm90(quant._quantize_kernel, dict(FMT=lay.fmt, BITS=lay.bits, GROUP=lay.group_size, PAGE_SHIFT=21,
                                                  BLOCK_N=block_n, BLOCK_K=lay.group_size or 128))
        compile_sm90(quant._dequantize_kernel, dict(FMT=lay.fmt, BITS=lay.bits, GROUP=lay.group_size or 1,
                                                    PAGE_SHIFT=21, FP8_NATIVE=True, EXACT_BF16=False, BLOCK_N=16,
                                                    BLOCK_K=64))
        print(f"quant {prec} ok")
    """
)


@pytest.mark.e2e
def test_kernels_compile_for_sm90_with_vector_loads(tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    script = tmp_path / "compile_sm90.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    done = proc.run([sys.executable, str(script)], env=env, quiet_s=15)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.rsplit(" ", 1) for line in done.stdout.splitlines() if line.startswith("gemm"))
    for prec in ("bf16", "fp8-b128", "fp8", "int4"):  # the per-row-chunk and packed paths: 16-byte weight copies
        for which in ("gate_up", "down"):
            copies = int(lines[f"gemm {prec} {which} row_chunk=True"].split("=")[1])
            assert copies > 0, f"{prec} {which}: weight tiles no longer load as 16-byte copies"
    assert sum(line.startswith("quant") for line in done.stdout.splitlines()) == 5
    assert "gemm gelu ok" in done.stdout
