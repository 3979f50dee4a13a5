"""The agent: command line, target checks, the sampling loop and the live status."""
