"""The agent's end of its link to the in-process probe (``probe/`` is the job's end).

``connect`` finds the probe's socket, or injects the probe, and opens a
``client`` on it, saying what it waits for meanwhile (``progress``); ``channel``
keeps that link across a pass's deadlines, late replies, retries and an exec of
the job (``ProbeSource``), ``start`` opens it for `attach` without holding up
the first sample, and ``exchanges`` runs one
request to each target's probe per pass. What comes back is checked and
decoded into typed samples (``samples``, with ``reply_rows`` cutting rows to
the budget before they are built and ``reply_pacing`` decoding large replies
less often), and ``series_budget`` folds them to the agent's series budgets."""
