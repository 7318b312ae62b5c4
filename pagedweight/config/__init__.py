"""What users write: scenario files (``scenario``, ``workload``), latency-model settings
(``latency``) and the kernel latency-table format ``pwgpu profile`` writes (``kernel_table``),
validated with errors naming the file, the key and the allowed values."""
