"""The memory model and the step: exact sizes (``spec``), the unified page pool and KV block
allocator (``pool``), the expert page table (``pagetable``), continuous batching (``scheduler``),
the shape of a step (``step``) and the one object both runtimes drive (``runtime``)."""
