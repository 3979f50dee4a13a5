"""Workloads that exercise the agent: a synthetic busy process now, the papers'
reference models later."""
