"""What a run leaves: request and step metrics (``metrics``), the results directory (``writer``),
simulator-vs-engine validation (``validation``) and the HTML report (``report*``)."""
