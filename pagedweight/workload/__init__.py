"""Requests to replay: trace loaders (``traces``), arrival processes (``arrivals``), the trace a
scenario asks for (``build``), synthetic traces (``synth``) and trace statistics (``stats``)."""
