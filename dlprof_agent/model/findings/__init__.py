"""Findings: where the job's time goes and what to change, concluded from what the
agent already measures, the way the papers concluded by hand.

Each rule is a pure function of a short window of recent samples. It answers
None when the job gives it nothing to judge (no probe, no GPU, no steps yet),
else whether its cause holds now, with the figures that say so. A finding is
raised once its cause has held for ``RAISE_AFTER_SECONDS`` and cleared once it
has been gone for ``CLEAR_AFTER_SECONDS``, so one odd sample neither raises nor
clears one. Everything runs on the agent's sampling clock; scrapes only render
the result. docs/findings.md lists the rules with their sources.

``catalogue``: what each finding means and advises, and its records (what
exporters and dashboards read); ``window``: the recent samples a rule sees;
``rules``: the rules; ``tracker``: raising and clearing, per target.
"""
