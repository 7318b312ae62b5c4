"""Triton kernels of the engine and their PyTorch references.

- ``layout``: the packed byte layout of every precision and the page table (read this first).
- ``quant``: quantise / dequantise kernels writing and reading that layout through pages.
- ``moe_gemm``: the fused mixed-precision MoE expert FFN through the page table.
- ``tile_io``: device functions shared by both: address translation, FP8 codec, tile loads.
- ``paging``: ``PagedExperts``, one layer's experts in a pool; ``block_config``: block sizes.
- ``reference``: pure-PyTorch references, also the engine's CPU path.

``layout``, ``paging`` and ``reference`` import no Triton; import the submodules you need.
"""
