"""What precision each expert gets and when it changes: importance tables and the routing-drift
tracker (``importance``), the allocation problem (``problem``) and its solvers (``allocate``,
``hull``, ``exact``), the controller that moves precision under KV pressure (``controller``) and
the named policies (``policies``)."""
